"""`pdserve bench` as a `vllm bench serve` user drives it: flags, goodput, datasets, result keys, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadgen.client import RequestRecord
from loadgen.datasets import as_text, sharegpt_requests
from loadgen.summary import SLO, parse_goodput, vllm_figures
from loadgen.workload import build_requests, poisson_arrivals
from pdserve.bench import BenchSettings, bench_config
from pdserve.main import build_parser, main


def settings(*argv: str) -> BenchSettings:
    args = build_parser().parse_args(["bench", *argv])
    given = {k: v for k, v in vars(args).items() if k in BenchSettings.model_fields and v is not None}
    return BenchSettings(**given)


def test_goodput_pairs_are_milliseconds_and_unnamed_metrics_are_unbounded() -> None:
    assert parse_goodput(["ttft:500", "e2el:2000"]) == SLO(0.5, math.inf, 2.0)
    for bad, needle in (["ttfb:5"], "one of ttft"), (["ttft=5"], "one of ttft"), (["tpot:x"], "KEY:MS"), \
            (["e2el:-1"], ">= 0"):
        with pytest.raises(ValueError, match=needle):
            parse_goodput(bad)


def test_an_infinite_rate_sends_everything_at_once_and_a_range_ratio_spreads_lengths() -> None:
    assert poisson_arrivals(math.inf, 4, __import__("random").Random(0)) == [0.0] * 4
    specs = build_requests(200, 1000, rate=math.inf, input_len=100, output_len=10, range_ratio=0.5)
    assert all(s.arrival_s == 0 for s in specs)
    lengths = [len(s.prompt_token_ids) for s in specs]
    assert min(lengths) >= 50 and max(lengths) <= 150 and len(set(lengths)) > 20
    assert build_requests(3, 1000, rate=1.0, input_len=7, output_len=2) == build_requests(
        3, 1000, rate=1.0, input_len=7, output_len=2, range_ratio=0.0)


def test_sharegpt_takes_the_first_human_turn_and_a_fixed_or_counted_output(tmp_path: Path) -> None:
    data = [{"conversations": [{"from": "gpt", "value": "hi"},
                               {"from": "human", "value": "Why is the sky blue?"},
                               {"from": "gpt", "value": "Rayleigh scattering."}]},
            {"conversations": [{"from": "human", "value": "alone"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    specs = sharegpt_requests(path, 3, 0, math.inf, 1.0, 12, None)
    assert [(s.prompt_text, s.output_len) for s in specs] == [("Why is the sky blue?", 12)] * 3
    with pytest.raises(ValueError, match="--sharegpt-output-len, or --tokenizer"):
        sharegpt_requests(path, 3, 0, math.inf, 1.0, None, None)


def test_chat_prompts_are_words_as_many_as_the_token_ids() -> None:
    specs = as_text(build_requests(2, 1000, rate=1.0, input_len=9, output_len=2), seed=0)
    assert all(len((s.prompt_text or "").split()) == 9 for s in specs)


def test_the_result_carries_vllms_keys() -> None:
    records = [RequestRecord(i, 0.0, 0.0, 10, 4, 0.1, 0.4, [0.1, 0.2, 0.3, 0.4], 4, 200) for i in range(3)]
    records.append(RequestRecord(3, 0.0, 0.0, 10, 4, status=500, error="boom"))
    figures = vllm_figures(records, ("ttft", "tpot", "itl", "e2el"), (50.0, 99.0, 99.9), SLO(0.2, 0.2))
    for key in ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_tpot_ms", "std_itl_ms", "p99_e2el_ms", "p99.9_ttft_ms", "p50_itl_ms"):
        assert key in figures, key
    assert (figures["completed"], figures["failed"], figures["total_output_tokens"]) == (3, 1, 12)
    assert figures["median_ttft_ms"] == pytest.approx(100.0)
    assert figures["p50_tpot_ms"] == pytest.approx(100.0)


def test_the_url_alias_and_env_vars_set_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    alias = settings("--url", "http://h:1", "--request-rate", "inf")
    named = settings("--base-url", "http://h:1", "--request-rate", "inf")
    assert alias == named and math.isinf(bench_config(named).rate)
    monkeypatch.setenv("PDSERVE_BENCH_MAX_CONCURRENCY", "8")
    assert settings().max_concurrency == 8
    assert settings("--max-concurrency", "2").max_concurrency == 2
    trace = settings("--dataset-path", "t.csv")
    assert (bench_config(trace).dataset, bench_config(trace).rate) == ("trace", None)


@pytest.mark.parametrize(("argv", "needle"), [
    (["--request-rate", "0"], "--request-rate: Input should be greater than 0"),
    (["--goodput", "ttft"], "--goodput: 'ttft': expected KEY:MS"),
    (["--percentile-metrics", "ttft,foo"], "--percentile-metrics: foo unknown"),
    (["--dataset-name", "sharegpt"], "--dataset-path: ShareGPT needs its JSON file"),
])
def test_bad_flags_name_the_flag(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--disable-tqdm", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_an_unreachable_server_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    status = main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--disable-tqdm",
                   "--out", str(tmp_path)])
    error = capsys.readouterr().err
    assert status == 2 and "--base-url: the server does not answer: http://127.0.0.1:9" in error
    assert "Traceback" not in error
