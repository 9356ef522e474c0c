"""`pdserve bench` against the real server, and the colocated baseline behind the same gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import ServeConfig
from llm_engine.model_files import load_tokenizer
from pdserve.main import main
from tests.helpers.reference import hf_greedy
from tests.helpers.servers import API_KEY, MODEL, SHARED, free_port, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow


def bench_argv(server: str, out: Path, *flags: str) -> list[str]:
    return ["bench", "--base-url", server, "--vocab-size", "49152", "--api-key", API_KEY, "--out", str(out),
            "--disable-tqdm", *flags]


def bench(server: str, out: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pdserve bench` as its own process: where the exit status is what is tested."""
    command = [sys.executable, "-m", "pdserve", *bench_argv(server, out, *flags)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def bench_here(capsys: pytest.CaptureFixture[str], server: str, out: Path, *flags: str
               ) -> subprocess.CompletedProcess[str]:
    """`pdserve bench` called in this process (the same main() the command runs, without a Python start and
    its imports per run), its output as a process's."""
    capsys.readouterr()
    returncode = main(bench_argv(server, out, *flags))
    captured = capsys.readouterr()
    return subprocess.CompletedProcess(["pdserve", "bench"], returncode, captured.out, captured.err)


def test_pdserve_bench_writes_results_matching_what_it_sent(server: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench"
    # The old flag names, still aliases. SLOs no loaded machine misses: goodput counts requests, not speed
    # (5 s / 1 s made it 0 once, the suite's heaviest minute on the other worker).
    result = bench_here(capsys, server, out, "--request-rate", "8", "--num-prompts", "12",
                        "--random-input-len", "20", "--random-output-len", "6", "--ignore-eos",
                        "--ttft-slo-s", "120", "--itl-slo-s", "60")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == summary["num_requests"] == 12
    assert summary["num_ok"] + summary["num_errors"] == 12 and summary["num_ok"] == 12
    assert all(r["num_output_tokens"] == 6 and r["timings"] for r in records)
    assert summary["stage_ms_over_requests"]["prefill_ms"]["p50"] > 0
    assert 0 < summary["goodput"] <= summary["request_throughput"]
    for png in ("latency_cdf.png", "stage_breakdown.png", "queues_over_time.png"):
        assert (out / png).stat().st_size > 0
    assert (out / "metrics.jsonl").read_text().strip()


def test_all_at_once_under_a_concurrency_cap_with_vllms_result_keys(
        server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bench_here(capsys, server, tmp_path / "bench", "--request-rate", "inf", "--max-concurrency", "8",
                        "--num-prompts", "16", "--random-input-len", "24", "--random-output-len", "5",
                        "--ignore-eos",
                        "--temperature", "0", "--num-warmups", "1", "--goodput", "ttft:60000", "tpot:60000",
                        "--save-result", "--result-dir", str(tmp_path / "results"),
                        "--result-filename", "r.json")
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "results" / "r.json").read_text())
    assert (saved["completed"], saved["failed"], saved["max_concurrency"], saved["request_rate"]) == (
        16, 0, 8, "inf")
    assert saved["total_input_tokens"] == 16 * 24 and saved["total_output_tokens"] == 16 * 5
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    for key in ("duration", "request_throughput", "output_throughput", "mean_ttft_ms", "median_tpot_ms",
                "std_itl_ms", "p99_e2el_ms", "p90_ttft_ms", "model_id"):
        assert saved[key] is not None, key
    records = [json.loads(line) for line in (tmp_path / "bench" / "requests.jsonl").read_text().splitlines()]
    # At most 8 in flight: the 9th request left only after one of the first 8 had finished.
    finished = sorted(r["sent_s"] + r["e2e_s"] for r in records)
    assert sorted(r["sent_s"] for r in records)[8] >= finished[0]


def test_chat_endpoint_counts_tokens_from_usage(server: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    result = bench_here(capsys, server, tmp_path / "bench", "--endpoint", "/v1/chat/completions",
                        "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
                        "--ignore-eos")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["completed"] == 3 and summary["total_output_tokens"] == 12
    assert summary["total_input_tokens"] > 3 * 8  # the chat template's tokens around each message count too


def test_a_run_where_every_request_fails_exits_non_zero_saying_how_many(server: str, tmp_path: Path) -> None:
    result = bench(server, tmp_path / "bench", "--model", "no-such-model", "--num-prompts", "4",
                   "--random-input-len", "8", "--random-output-len", "2")
    assert result.returncode == 1
    assert "4 of 4 requests failed" in result.stderr and "Traceback" not in result.stderr


def test_bench_flag_errors_name_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "--request-rate", "-1"], capture_output=True, text=True,
    )
    assert result.returncode == 2 and "--request-rate" in result.stderr


@pytest.fixture(scope="module")
def colocated_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    config = ServeConfig(dtype="float32", model=str(tiny_chat_model_dir),
        served_model_name=MODEL,
        mixed=2,
        port=free_port(),
        kv_cache_mib=4,
        max_num_batched_tokens=64,
        api_key=API_KEY,
    )
    SHARED.close()  # the shared server's workers first: serving() ends once every CPU of Ray is free again
    with serving(config) as (url, _):
        yield url


def test_colocated_workers_serve_the_same_tokens(colocated_server: str, tiny_chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    prompts = [
        "A long time ago in a galaxy far away",
        "Hello",
        "One two three four five six seven eight nine",
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=colocated_server, headers=headers, timeout=120) as client:
        pools = client.get("/admin/pools").json()
        assert (pools["prefill"], pools["decode"], pools["mixed"]) == (0, 0, 2)  # counted by kind
        for prompt in prompts:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "return_token_ids": True,
            }
            data = client.post("/v1/completions", json=body).json()
            expected = hf_greedy(tiny_chat_model_dir, [tokenizer.encode(prompt)], 10)[0]
            assert data["choices"][0]["token_ids"] == expected
            timings = data["timings"]
            assert timings["transfer_bytes"] == 0 and timings["prefill_ms"] > 0 and timings["decode_ms"] > 0
        assert wait_until_no_blocks_used(client) == 0
