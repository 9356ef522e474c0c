"""Load generator arithmetic: trace parsing, arrivals, percentiles, goodput."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from loadgen.client import RequestRecord
from loadgen.sampler import parse_sample
from loadgen.summary import SLO, percentile, summarize
from loadgen.workload import build_requests, poisson_arrivals, read_trace

AZURE = Path(__file__).parents[3] / "shared" / "traces" / "azure_conv_2023.csv"


def test_azure_csv(tmp_path: Path) -> None:
    trace = tmp_path / "azure.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
    )
    rows = read_trace(trace)
    assert [(r.input_len, r.output_len) for r in rows] == [(374, 44), (396, 109)]
    assert rows[0].timestamp_s == 0.0 and rows[1].timestamp_s == pytest.approx(4.314579, abs=1e-6)


@pytest.mark.skipif(not AZURE.is_file(), reason="shared/traces not beside the checkout")
def test_the_shared_azure_trace_parses() -> None:
    rows = read_trace(AZURE)
    assert len(rows) == 19366 and statistics.fmean(r.input_len for r in rows) == pytest.approx(
        1154.7, abs=0.1
    )


def test_mooncake_jsonl_shares_prefix_blocks(tmp_path: Path) -> None:
    trace = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_length": 12, "output_length": 3, "hash_ids": [1, 3]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parsed = read_trace(trace)
    assert parsed[1].timestamp_s == 0.5 and parsed[1].hash_ids == (1, 3)
    # length_scale 1/64 makes Mooncake's 512-token blocks 8 tokens long.
    full = build_requests(2, 1000, trace=parsed, length_scale=1 / 64, input_len=16, output_len=4)
    assert full[0].prompt_token_ids[:8] == full[1].prompt_token_ids[:8]  # hash id 1 in both
    assert full[0].prompt_token_ids[8:16] != full[1].prompt_token_ids[8:16]  # 2 vs 3
    assert [s.arrival_s for s in full] == [0.0, 0.5]


def test_bad_trace_names_the_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_trace(trace)


def test_poisson_and_gamma_arrivals_have_the_asked_rate() -> None:
    for burstiness in (1.0, 0.25):
        times = poisson_arrivals(4.0, 20000, random.Random(1), burstiness)
        gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
        assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
        # Coefficient of variation of gamma gaps is 1/sqrt(shape): burstier means more spread.
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(burstiness**-0.5, rel=0.1)
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, random.Random(0))


def test_fixed_lengths_and_duration_cut() -> None:
    specs = build_requests(50, 100, rate=10.0, input_len=7, output_len=3, duration_s=1.0)
    assert specs and all(len(s.prompt_token_ids) == 7 and s.output_len == 3 for s in specs)
    assert all(s.arrival_s <= 1.0 for s in specs) and len(specs) < 50


def test_percentile_interpolates() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile(list(range(101)), 90) == 90
    assert str(percentile([], 50)) == "nan"


def record(index: int, ttft: float, e2e: float, tokens: int, error: str = "") -> RequestRecord:
    times = [ttft + i * (e2e - ttft) / max(1, tokens - 1) for i in range(tokens)]
    return RequestRecord(
        index, 0.0, float(index), 10, tokens, ttft, e2e, times, tokens, 200 if not error else 500, error
    )


def test_goodput_counts_requests_meeting_both_slos() -> None:
    records = [
        record(0, ttft=0.1, e2e=1.0, tokens=10),  # TPOT 0.1: meets both
        record(1, ttft=0.5, e2e=1.4, tokens=10),  # TTFT misses
        record(2, ttft=0.1, e2e=3.1, tokens=11),  # TPOT 0.3 misses
        record(3, ttft=0.1, e2e=0.5, tokens=5, error="boom"),
    ]
    summary = summarize(records, SLO(ttft_s=0.2, itl_s=0.2))
    assert (summary["num_requests"], summary["num_ok"], summary["num_errors"]) == (4, 3, 1)
    duration = summary["duration_s"]
    assert duration == pytest.approx(5.1)  # first sent at 0, last (index 2) ends at 2 + 3.1
    assert summary["goodput"] == pytest.approx(1 / duration)
    assert summary["tpot_s_over_requests"]["p50"] == pytest.approx(0.1)  # type: ignore[index]


def test_metrics_sample_parsing() -> None:
    text = (
        'pdserve:queued_prompt_tokens{model_name="m",pool="prefill"} 120.0\n'
        'pdserve:kv_cache_usage_perc{model_name="m",role="decode",worker="decode-1"} 0.25\n'
        'pdserve:num_requests_running{model_name="m",role="decode",worker="decode-1"} 3.0\n'
    )
    sample = parse_sample(text, 1.5)
    assert sample.queued_prompt_tokens == {"prefill": 120.0}
    assert sample.kv_occupancy == {"decode-1": 0.25} and sample.running_requests == {"decode-1": 3.0}


def test_a_prompt_seed_changes_the_prompts_and_nothing_else() -> None:
    base = build_requests(20, 1000, seed=3, rate=2.0, input_len=50, output_len=8)
    other = build_requests(20, 1000, seed=3, rate=2.0, input_len=50, output_len=8, prompt_seed=1)
    assert [(r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in base] == [
        (r.arrival_s, len(r.prompt_token_ids), r.output_len) for r in other]
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(base, other, strict=True))
    assert build_requests(20, 1000, seed=3, rate=2.0, input_len=50, output_len=8) == base  # unchanged default
