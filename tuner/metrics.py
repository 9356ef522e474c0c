"""A simulated run scored as `pdserve bench` scores a measured one (loadgen/summary.py), so that predicted
and measured figures mean the same thing:
    SLO attainment  fraction of all requests that finished with TTFT <= ttft SLO and TPOT (mean time per
                    output token after the first) <= itl SLO: loadgen's SLO.is_met, called on each request
    goodput         those requests per second of the run (first send to last token)
    TTFT            percentiles over requests; ITL percentiles over tokens (every gap between two tokens)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from loadgen.client import RequestRecord
from loadgen.summary import SLO, percentile
from tuner.simulator import Layout, SimResult

# A layout "holds" a rate when at least this fraction of its requests meet the SLO (issue 11).
HOLD_ATTAINMENT = 0.9


def token_percentile(result: SimResult, q: float) -> float:
    """The q-th percentile of every inter-token gap: a step's length counts once per token it carried."""
    values = [gap for gap, _ in result.itl_steps] + list(result.itl_gaps)
    weights = [n for _, n in result.itl_steps] + [1] * len(result.itl_gaps)
    if not values or sum(weights) == 0:
        return math.nan
    order = np.argsort(values, kind="stable")
    ordered = np.asarray(values)[order]
    ends = np.cumsum(np.asarray(weights)[order])  # the expanded list's index of each value's last copy + 1
    position = (ends[-1] - 1) * q / 100.0  # as loadgen's percentile does over the expanded list
    low = math.floor(position)
    high = min(low + 1, int(ends[-1]) - 1)

    def at(index: int) -> float:
        return float(ordered[int(np.searchsorted(ends, index, side="right"))])

    return at(low) + (at(high) - at(low)) * (position - low)


@dataclass(frozen=True)
class LayoutScore:
    """One layout at one rate, as the plan's table shows it."""

    layout: Layout
    rate: float | None  # requests/s; None: the trace's own timestamps
    num_requests: int
    num_ok: int  # finished (not refused by admission)
    attainment: float  # SLO attainment (0–1)
    goodput: float  # requests/s meeting the SLO
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    utilization: dict[str, float]  # kind → fraction of the run its workers spent in forwards
    backlog_growth: float  # requests in the system: least-squares slope over the run (per second; > 0 grows)
    num_preemptions: int

    @property
    def holds(self) -> bool:
        return self.attainment >= HOLD_ATTAINMENT

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["layout"] = self.layout.to_dict()
        data["label"] = self.layout.label()
        return data


def score(result: SimResult, slo: SLO, rate: float | None) -> LayoutScore:
    records = [
        RequestRecord(i, arrival, arrival, 0, n, ttft_s=ttft, e2e_s=e2e, num_output_tokens=n)
        for i, (arrival, ttft, e2e, n) in enumerate(
            zip(result.arrival_s, result.ttft_s, result.e2e_s, result.num_output_tokens, strict=True))
    ]
    ok = [r for r in records if r.e2e_s is not None]
    for r in records:
        if r.ttft_s is None:
            r.error = "refused"
    duration = math.nan
    if ok:
        start = min(r.sent_s for r in records)
        duration = max(max(r.sent_s + (r.e2e_s or 0.0) for r in ok) - start, 1e-9)
    num_met = sum(1 for r in ok if slo.is_met(r))
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    layout = result.layout
    counts = {"prefill": layout.prefill, "decode": layout.decode, "mixed": layout.mixed}
    utilization = {kind: busy / (counts[kind] * duration) for kind, busy in result.busy_s.items()
                   if counts[kind] and duration > 0}
    growth = 0.0
    if len(result.backlog) >= 2:
        times, depth = zip(*result.backlog, strict=True)
        if max(times) > min(times):
            growth = float(np.polyfit(times, depth, 1)[0])
    return LayoutScore(
        layout, rate, len(records), len(ok), num_met / len(records) if records else 0.0,
        num_met / duration if ok else 0.0,
        percentile(ttfts, 50), percentile(ttfts, 90), percentile(ttfts, 99),
        token_percentile(result, 50), token_percentile(result, 99),
        utilization, growth, result.num_preemptions,
    )
