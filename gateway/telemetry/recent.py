"""Recent request latencies (a sliding window), for the ratio controller's view of the SLOs.

Bounded where it is added: add() drops what left the window and keeps at most MAX_REQUESTS requests, and of
each request's token gaps only a strided sample of at most GAPS_PER_REQUEST (weighted by how many gaps each
stands for). So memory stays fixed whether or not anybody reads the quantiles (auto off: nobody does), and a
quantile sorts at most MAX_REQUESTS × GAPS_PER_REQUEST values, however many tokens the window saw.

Quantiles are numpy's, as `pdserve bench` computes its percentiles (loadgen/summary.py): `numpy.quantile`,
linear between order statistics, so the controller's TTFT p90 is the bench's p90 of the same requests. The
ITL quantile is weighted (each sampled gap stands for several), and numpy weighs only by the inverted CDF:
the smallest gap with at least q of the weight at or below it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import numpy as np

from gateway.telemetry.timings import Timings

MAX_REQUESTS = 1024  # requests kept in the window (the newest); enough for a p90 and cheap to sort
GAPS_PER_REQUEST = 8  # token gaps kept per request, for the ITL quantile


@dataclass(frozen=True)
class _Finished:
    at: float  # time.monotonic() when it finished
    ttft_s: float
    tpot_s: float | None  # mean gap between tokens; None with fewer than two tokens
    gaps_s: tuple[float, ...]  # a strided sample of its token gaps (at most GAPS_PER_REQUEST)
    gap_weight: float  # gaps each sampled one stands for
    arrived: float  # time.monotonic() when it reached the gateway
    moved: bool  # its stream moved to another worker (a failure, a drain, a role change)


class RecentLatencies:
    """TTFT and inter-token gaps of the requests that finished in the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0, min_requests: int = 3, max_requests: int = MAX_REQUESTS
                 ) -> None:
        self.window_s = window_s
        self.min_requests = min_requests  # fewer than this in the window: no verdict (None)
        self._finished: collections.deque[_Finished] = collections.deque(maxlen=max_requests)

    def __len__(self) -> int:
        return len(self._finished)

    @property
    def num_gaps_kept(self) -> int:
        return sum(len(x.gaps_s) for x in self._finished)

    def add(self, timings: Timings, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._trim(now)
        gaps = timings.token_gaps_ms
        stride = max(1, -(-len(gaps) // GAPS_PER_REQUEST))  # ceil: at most GAPS_PER_REQUEST samples
        sample = tuple(gap / 1000 for gap in gaps[stride // 2::stride])
        tpot = sum(gaps) / len(gaps) / 1000 if gaps else None
        self._finished.append(_Finished(now, timings.ttft_ms / 1000, tpot, sample,
                                        len(gaps) / len(sample) if sample else 0.0,
                                        now - timings.e2e_ms / 1000, timings.num_moves > 0))

    def _trim(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._finished and self._finished[0].at < cutoff:
            self._finished.popleft()

    def _window(self, since: float) -> list[_Finished]:
        self._trim(time.monotonic())
        return [x for x in self._finished if x.at >= since]

    def ttft_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        """The q-quantile of TTFT of requests that finished in the window and after `since` (monotonic)."""
        window = self._window(since)
        if len(window) < self.min_requests:
            return None
        return float(np.quantile([x.ttft_s for x in window], q))

    def tpot_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        """The q-quantile over requests of their mean gap between tokens (TPOT: what goodput's SLO checks)."""
        window = self._window(since)
        tpots = [x.tpot_s for x in window if x.tpot_s is not None]
        if len(window) < self.min_requests or not tpots:
            return None
        return float(np.quantile(tpots, q))

    def attainment(self, ttft_slo_s: float, tpot_slo_s: float, since: float = float("-inf")) -> float | None:
        """The fraction of requests in the window (finished after `since`) that met both SLOs."""
        window = self._window(since)
        if len(window) < self.min_requests:
            return None
        met = sum(x.ttft_s <= ttft_slo_s and (x.tpot_s is None or x.tpot_s <= tpot_slo_s) for x in window)
        return met / len(window)

    def settled_attainment(self, ttft_slo_s: float, tpot_slo_s: float, since: float, min_requests: int
                           ) -> float | None:
        """As attainment(), over the requests that arrived at or after `since` (monotonic: a change's end)
        and did not move: what the fleet as it is now serves, not the change's own transients (streams it
        moved, requests that queued while it applied). None under `min_requests` of them."""
        settled = [x for x in self._window(since) if x.arrived >= since and not x.moved]
        if len(settled) < min_requests:
            return None
        return sum(x.ttft_s <= ttft_slo_s and (x.tpot_s is None or x.tpot_s <= tpot_slo_s)
                   for x in settled) / len(settled)

    def itl_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        """The q-quantile over tokens of the gap before each (from each request's sample, weighted)."""
        window = self._window(since)
        gaps = [gap for x in window for gap in x.gaps_s]
        if len(window) < self.min_requests or not gaps:
            return None
        weights = [x.gap_weight for x in window for _ in x.gaps_s]
        return float(np.quantile(gaps, q, weights=weights, method="inverted_cdf"))
