"""Recent request latencies (a sliding window), for the ratio controller's view of the SLOs."""

from __future__ import annotations

import collections
import time

from gateway.telemetry.timings import Timings


class RecentLatencies:
    """TTFT and inter-token gaps of the requests that finished in the last `window_s` seconds."""

    def __init__(self, window_s: float = 30.0, min_requests: int = 3) -> None:
        self.window_s = window_s
        self.min_requests = min_requests  # fewer than this in the window: no verdict (None)
        self._finished: collections.deque[tuple[float, float, list[float]]] = collections.deque()

    def add(self, timings: Timings, now: float | None = None) -> None:
        self._finished.append((now or time.monotonic(), timings.ttft_ms / 1000,
                               [gap / 1000 for gap in timings.token_gaps_ms]))

    def _window(self) -> list[tuple[float, float, list[float]]]:
        cutoff = time.monotonic() - self.window_s
        while self._finished and self._finished[0][0] < cutoff:
            self._finished.popleft()
        return list(self._finished)

    def ttft_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        """The q-quantile of TTFT of requests that finished in the window and after `since` (monotonic)."""
        window = [x for x in self._window() if x[0] >= since]
        if len(window) < self.min_requests:
            return None
        return _quantile([ttft for _, ttft, _ in window], q)

    def tpot_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        """The q-quantile over requests of their mean gap between tokens (TPOT: what goodput's SLO checks)."""
        window = [x for x in self._window() if x[0] >= since]
        tpots = [t for _, _, gaps in window if (t := _tpot(gaps)) is not None]
        if len(window) < self.min_requests or not tpots:
            return None
        return _quantile(tpots, q)

    def itl_quantile(self, q: float, since: float = float("-inf")) -> float | None:
        window = [x for x in self._window() if x[0] >= since]
        gaps = [gap for _, _, request_gaps in window for gap in request_gaps]
        if len(window) < self.min_requests or not gaps:
            return None
        return _quantile(gaps, q)


def _tpot(gaps: list[float]) -> float | None:
    return sum(gaps) / len(gaps) if gaps else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
