"""The recent traffic's shape (a sliding window): when each finished request arrived, its prompt tokens and
the tokens it generated. The ratio controller's planner replays it through the tuner's simulator.

Bounded where it is added: at most MAX_REQUESTS, and nothing older than the window.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

MAX_REQUESTS = 4096


@dataclass(frozen=True)
class Arrival:
    at: float  # time.time() when the request arrived at the gateway
    prompt_tokens: int
    output_tokens: int


class RecentTraffic:
    def __init__(self, window_s: float = 60.0, max_requests: int = MAX_REQUESTS) -> None:
        self.window_s = window_s
        self._arrivals: collections.deque[Arrival] = collections.deque(maxlen=max_requests)

    def add(self, arrival: Arrival) -> None:
        self._arrivals.append(arrival)
        cutoff = time.time() - 2 * self.window_s  # kept a little past the window: finishes lag arrivals
        while self._arrivals and self._arrivals[0].at < cutoff:
            self._arrivals.popleft()

    def window(self, now: float | None = None) -> list[Arrival]:
        """The requests that arrived in the last window_s seconds (and have finished), oldest first."""
        cutoff = (time.time() if now is None else now) - self.window_s
        return sorted((a for a in self._arrivals if a.at >= cutoff), key=lambda a: a.at)
