"""The run's summary: percentiles (over requests or over tokens, as labelled), throughput and goodput.

Goodput = requests per second that finished without error, with TTFT <= the TTFT SLO, TPOT (mean time per
output token after the first) <= the ITL SLO and end-to-end latency <= the e2el SLO (unbounded unless set).
Percentiles are numpy's (`numpy.percentile`, linear between order statistics), as vLLM reports them and as
the ratio controller reads its window (gateway/telemetry/recent.py): one definition of a p90 everywhere.

Two views of one run: pdserve's own (`summarize`: seconds, stage timings) and the figures under vLLM's
`vllm bench serve` key names (`vllm_figures`: ms, `completed`, `p99_ttft_ms`, ...), so that a result file
reads next to vLLM's.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import numpy as np

from loadgen.client import RequestRecord

# A request's stages and, between them, the hops between processes: together they add up to its e2e_ms.
STAGES = ("gateway_queue_ms", "to_prefill_ms", "prefill_queue_ms", "prefill_ms", "handoff_ms", "transfer_ms",
          "decode_queue_ms", "decode_ms", "delivery_ms")
QUANTILES = (50, 90, 99)
# The latency targets every command shares (serve's ratio controller, bench's goodput, tune's planner): the
# one place they are defined. A CPU prefills a few hundred tokens per second, so 3 s holds a ~1000-token
# prompt; 0.2 s per token reads faster than people do.
DEFAULT_TTFT_SLO_S = 3.0
DEFAULT_ITL_SLO_S = 0.2
# vLLM's metric names (`--percentile-metrics`) and what each is measured over.
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) by `numpy.percentile` (linear between order statistics); NaN for none."""
    return float(np.percentile(values, q)) if values else math.nan


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


@dataclass(frozen=True)
class SLO:
    ttft_s: float = DEFAULT_TTFT_SLO_S
    itl_s: float = DEFAULT_ITL_SLO_S  # held against each request's TPOT
    e2el_s: float = math.inf

    def is_met(self, record: RequestRecord) -> bool:
        if record.error or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        if record.e2e_s is not None and record.e2e_s > self.e2el_s:
            return False
        tpot = record.tpot_s
        return tpot is None or tpot <= self.itl_s


def parse_goodput(pairs: list[str]) -> SLO:
    """vLLM's `--goodput ttft:MS tpot:MS e2el:MS` as an SLO (a metric not named is unbounded).

    Raises:
        ValueError: a pair that is not NAME:MS, an unknown name, or a negative value.
    """
    limits_s = {"ttft": math.inf, "tpot": math.inf, "e2el": math.inf}
    for pair in pairs:
        name, _, value = pair.partition(":")
        if name not in limits_s:
            raise ValueError(f"{pair!r}: the metric is one of ttft, tpot, e2el (as KEY:MS)")
        try:
            limit_ms = float(value)
        except ValueError:
            raise ValueError(f"{pair!r}: expected KEY:MS, a number of milliseconds after the colon") from None
        if limit_ms < 0 or math.isnan(limit_ms):
            raise ValueError(f"{pair!r}: a limit must be >= 0 ms")
        limits_s[name] = limit_ms / 1000.0
    return SLO(limits_s["ttft"], limits_s["tpot"], limits_s["e2el"])


def _ok(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if not r.error and r.e2e_s is not None]


def run_duration_s(records: list[RequestRecord]) -> float:
    """From the first request sent to the last one finished."""
    if not records:
        return math.nan
    start = min(r.sent_s for r in records)
    end = max(r.sent_s + (r.e2e_s or 0.0) for r in records)
    return max(end - start, 1e-9)


def summarize(records: list[RequestRecord], slo: SLO) -> dict[str, object]:
    ok = _ok(records)
    duration = run_duration_s(records)
    num_tokens = sum(r.num_output_tokens for r in ok)
    stage_ms = {
        stage: percentiles([r.timings[stage] for r in ok if r.timings and stage in r.timings])
        for stage in STAGES
    }
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": num_tokens / duration,
        "goodput": sum(1 for r in ok if slo.is_met(r)) / duration,
        "slo": {"ttft_s": slo.ttft_s, "itl_s": slo.itl_s},
        "ttft_s_over_requests": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
        "itl_s_over_tokens": percentiles([gap for r in ok for gap in r.itls_s]),
        "tpot_s_over_requests": percentiles([t for r in ok if (t := r.tpot_s) is not None]),
        "e2e_s_over_requests": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        "stage_ms_over_requests": stage_ms,
    }


def _metric_values_s(ok: list[RequestRecord], metric: str) -> list[float]:
    if metric == "ttft":
        return [r.ttft_s for r in ok if r.ttft_s is not None]
    if metric == "tpot":
        return [t for r in ok if (t := r.tpot_s) is not None]
    if metric == "itl":
        return [gap for r in ok for gap in r.itls_s]
    return [r.e2e_s for r in ok if r.e2e_s is not None]


def peak_output_rate(records: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's `max_output_tokens_per_s` (tokens arrived in the busiest whole second of the run, counted from
    the first request sent) and `max_concurrent_requests` (most requests in flight at one instant), over
    the requests that succeeded; (0.0, 0) for none."""
    ok = _ok(records)
    if not ok:
        return 0.0, 0
    start = min(r.sent_s for r in ok)
    token_times = [r.sent_s + t - start for r in ok for t in r.token_times_s]
    per_second = np.bincount(np.asarray(token_times, dtype=np.int64)) if token_times else np.zeros(1)
    # In flight over [sent, sent + e2e): at a tie, one ending goes before one starting.
    events = sorted([(r.sent_s, 1) for r in ok] + [(r.sent_s + (r.e2e_s or 0.0), -1) for r in ok])
    in_flight = np.cumsum([step for _, step in events])
    return float(per_second.max()), int(in_flight.max())


def vllm_request_lists(records: list[RequestRecord]) -> dict[str, list[object]]:
    """vLLM's per-request lists (`--save-detailed`), one entry per request in index order, a failed one
    with zeros as vLLM writes it: seconds, start times from the run's start, `itls` per token."""
    return {
        "input_lens": [r.input_len for r in records],
        "output_lens": [0 if r.error else r.num_output_tokens for r in records],
        "ttfts": [r.ttft_s or 0.0 for r in records],
        "itls": [r.itls_s for r in records],
        "latencies": [r.e2e_s or 0.0 for r in records],
        "start_times": [r.sent_s for r in records],
        "queue_times": [max(0.0, r.sent_s - r.scheduled_s) for r in records],  # waited for a free slot
        "errors": [r.error for r in records],
    }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN: null where nothing was measured


def vllm_figures(records: list[RequestRecord], metrics: tuple[str, ...], quantiles: tuple[float, ...],
                 goodput_slo: SLO | None) -> dict[str, object]:
    """The run's figures under the key names of vLLM's `vllm bench serve` result JSON (ms; `pXX_<metric>_ms`
    for each metric in `metrics` and each percentile in `quantiles`; request_goodput only with an SLO)."""
    ok = _ok(records)
    duration = run_duration_s(records)
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.num_output_tokens for r in ok)
    figures: dict[str, object] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": (sum(1 for r in ok if goodput_slo.is_met(r)) / duration
                            if goodput_slo is not None else None),
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    figures["max_output_tokens_per_s"], figures["max_concurrent_requests"] = peak_output_rate(records)
    for metric in metrics:
        values_ms = [1000.0 * v for v in _metric_values_s(ok, metric)]
        figures[f"mean_{metric}_ms"] = statistics.fmean(values_ms) if values_ms else None
        figures[f"median_{metric}_ms"] = _finite_or_none(percentile(values_ms, 50))
        figures[f"std_{metric}_ms"] = statistics.pstdev(values_ms) if values_ms else None
        for q in quantiles:
            word = str(int(q)) if int(q) == q else str(q)  # vLLM's spelling: p99, p99.9
            figures[f"p{word}_{metric}_ms"] = _finite_or_none(percentile(values_ms, q))
    return figures
