"""The run's summary: percentiles (over requests or over tokens, as labelled), throughput and goodput.

Goodput = requests per second that finished without error, with TTFT <= the TTFT SLO and TPOT (mean time
per output token after the first) <= the ITL SLO. Percentiles interpolate linearly between order statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from loadgen.client import RequestRecord

# A request's stages and, between them, the hops between processes: together they add up to its e2e_ms.
STAGES = ("gateway_queue_ms", "to_prefill_ms", "prefill_queue_ms", "prefill_ms", "handoff_ms", "transfer_ms",
          "decode_queue_ms", "decode_ms", "delivery_ms")
QUANTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100), linear between order statistics; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    itl_s: float

    def is_met(self, record: RequestRecord) -> bool:
        if record.error or record.ttft_s is None or record.ttft_s > self.ttft_s:
            return False
        tpot = record.tpot_s
        return tpot is None or tpot <= self.itl_s


def summarize(records: list[RequestRecord], slo: SLO) -> dict[str, object]:
    ok = [r for r in records if not r.error and r.e2e_s is not None]
    if records:
        start = min(r.sent_s for r in records)
        end = max(r.sent_s + (r.e2e_s or 0.0) for r in records)
        duration = max(end - start, 1e-9)
    else:
        duration = math.nan
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
