"""`pdserve tune` flags: bad input ends with status 2 and names the flag; a good plan writes its files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.tuning import profile, sim_config, step_model, tune
from tuner.simulator import Layout
from tuner.table import recommendation


@pytest.fixture
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    model = step_model(prefill=(0.002, 2e-4, 1e-8), decode=(0.02, 0.002, 1e-6), transfer=(1e-4, 1e-9))
    profile(model, sim_config(num_blocks=2048)).save(path)
    return path


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        tune(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def plan_args(profile_path: Path, *more: str) -> list[str]:
    return ["plan", "--profile", str(profile_path), "--input-len", "64", "--output-len", "8", "--rate", "2",
            "--no-progress", *more]


@pytest.mark.parametrize(("flag", "value"),
                         [("--workers", "0"), ("--ttft-slo-s", "0"), ("--itl-slo-s", "-0.1")])
def test_zero_workers_or_non_positive_slos_name_the_flag(
        profile_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    argv = plan_args(profile_path, flag, value)
    if flag != "--workers":
        argv += ["--workers", "2"]
    assert f"{flag}: must be > 0" in fails(argv, capsys)


def test_an_unknown_trace_format_names_the_flag_and_the_formats(
        profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time,prompt,answer\n1,2,3\n")
    error = fails(["plan", "--profile", str(profile_path), "--trace", str(trace), "--workers", "2"], capsys)
    assert "--trace" in error and "TIMESTAMP,ContextTokens,GeneratedTokens" in error and "Mooncake" in error


def test_a_profile_that_is_not_one_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"hello": 1}))
    assert "--profile" in fails(plan_args(bad, "--workers", "2"), capsys)


def test_a_profile_of_another_model_than_the_servers_is_refused(
        profile_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tuner.apply.served_models", lambda access: ["SmolLM2-135M-Instruct"])
    error = fails(plan_args(profile_path, "--workers", "2", "--apply", "http://127.0.0.1:9"), capsys)
    assert "--profile" in error and "'tiny'" in error and "SmolLM2-135M-Instruct" in error


def test_validate_wants_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    not_a_plan = tmp_path / "plan.json"
    not_a_plan.write_text("[]")
    assert "--plan" in fails(["validate", "--url", "http://127.0.0.1:9", "--plan", str(not_a_plan)], capsys)


def test_plan_writes_plan_json_with_the_recommended_layout_and_a_heatmap(
        profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    status = tune(["plan", "--profile", str(profile_path), "--input-len", "256", "--output-len", "16",
                   "--rates", "1,4,8", "--workers", "3", "--num-requests", "60", "--target-rate", "4",
                   "--no-progress", "--out", str(out)])

    assert status == 0
    plan = json.loads((out / "plan.json").read_text())
    assert set(plan["recommended"]) == {"prefill", "decode", "mixed"}
    assert 1 <= sum(plan["recommended"].values()) <= 3
    assert len(plan["table"]) == 3 * 4  # 2P+1D, 1P+2D, 1P+1D+1M, 3M at each rate
    assert (out / "plan.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "recommended:" in printed and "target 4 req/s" in printed
    # The recommendation reads as a table of workers per pool (plan.json keeps the dict), not a dict's repr.
    lines = printed.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("recommended:"))
    assert lines[at + 1].split() == ["prefill", "decode", "mixed"]
    counts = [str(plan["recommended"][kind]) for kind in ("prefill", "decode", "mixed")]
    assert lines[at + 2].split() == ["workers", *counts]
    assert "{" not in "".join(lines[at:])


def test_the_recommendation_prints_the_serve_flags_that_set_it_up() -> None:
    lines = recommendation(Layout(prefill=0, decode=0, mixed=3), "3M holds 8 req/s")
    assert lines[0] == "recommended: 3M — 3M holds 8 req/s"
    assert lines[2].split() == ["workers", "0", "0", "3"]
    assert lines[3].endswith("pdserve serve ... --mixed 3")
    assert recommendation(Layout(1, 2), "")[3].endswith("--prefill 1 --decode 2")
