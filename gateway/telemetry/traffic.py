"""The recent traffic's shape (a sliding window): when each request arrived, its prompt tokens and the
tokens it generated. The ratio and scale controllers' planners replay it through the tuner's simulator.

    a request arrives (GatewayService.try_admit, before it waits for admission)
      → note(TrafficNote(..., output_tokens=None)): counted in the window from now, its output estimated
    it finishes
      → note(TrafficNote(..., output_tokens=n)): the same entry, its output now known
    window() → the requests that arrived in the last window_s seconds, as Arrivals

A request is counted from its arrival, not its finish: under a burst the requests that matter most are the
ones still waiting or running, and a window of finished requests alone would show the burst only as it
drains, too late to size the fleet for it. A running request's output is the mean of the last finished
ones (at most its max_tokens); one that never finishes (refused, cut, its client gone) stays counted with
that estimate: it was demand all the same.

Bounded where it is noted: at most MAX_REQUESTS, and nothing older than twice the window.
"""

from __future__ import annotations

import collections
import itertools
import time
from dataclasses import dataclass

MAX_REQUESTS = 4096
RECENT_OUTPUTS = 256  # finished requests whose mean output stands for a running request's
OUTPUT_GUESS_TOKENS = 256  # a running request's output while none has finished yet (at most its max_tokens)


@dataclass(frozen=True)
class Arrival:
    """One request as the simulator replays it."""

    at: float  # time.time() when the request arrived at the gateway
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TrafficNote:
    """A request's arrival (output_tokens None) or its finish, as the gateway or a frontend's report tells."""

    request_id: str
    at: float  # time.time() when the request arrived at the gateway
    prompt_tokens: int
    max_tokens: int  # the most it may generate (all its choices)
    output_tokens: int | None = None  # None: still running


class RecentTraffic:
    def __init__(self, window_s: float = 60.0, max_requests: int = MAX_REQUESTS) -> None:
        self.window_s = window_s
        self.max_requests = max_requests
        self._notes: collections.OrderedDict[str, TrafficNote] = collections.OrderedDict()
        self._outputs: collections.deque[int] = collections.deque(maxlen=RECENT_OUTPUTS)
        self._unnamed = itertools.count()

    def note(self, note: TrafficNote) -> None:
        """A request arrived, or finished (replacing its arrival's note, wherever it stands)."""
        if note.output_tokens is not None:
            self._outputs.append(note.output_tokens)
        self._notes[note.request_id] = note
        cutoff = time.time() - 2 * self.window_s  # kept a little past the window: a finish may come late
        while self._notes and (len(self._notes) > self.max_requests
                               or next(iter(self._notes.values())).at < cutoff):
            self._notes.popitem(last=False)

    def add(self, arrival: Arrival) -> None:
        """A finished request known by its shape alone (a replayed trace)."""
        self.note(TrafficNote(f"#{next(self._unnamed)}", arrival.at, arrival.prompt_tokens,
                              arrival.output_tokens, arrival.output_tokens))

    def window(self, now: float | None = None) -> list[Arrival]:
        """The requests that arrived in the last window_s seconds, finished or not, oldest first."""
        cutoff = (time.time() if now is None else now) - self.window_s
        guess = (round(sum(self._outputs) / len(self._outputs)) if self._outputs else OUTPUT_GUESS_TOKENS)
        return sorted((Arrival(n.at, n.prompt_tokens, n.output_tokens if n.output_tokens is not None
                               else max(1, min(n.max_tokens, guess)))
                       for n in self._notes.values() if n.at >= cutoff), key=lambda a: a.at)

