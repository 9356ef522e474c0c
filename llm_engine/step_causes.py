"""What made a forward slow, as the worker can name it (issue 49: a gap in a stream over ten times its
worker's median step needs a cause).

    One gc callback per process adds up the time of every collection (a collection on any thread holds the
    GIL, so the step thread waits for it too); torch's compile counter tells whether a forward compiled a
    new graph (a shape the compiled body had not seen). StepCauses: one per model runner, reading both.
    → before a forward: mark() → after it: since_mark() → (gc ms, graphs compiled) for its StepRecord
    → slow(duration, median) names the cause of a forward over SLOW_FACTOR × the recent median: "gc 1900 ms",
      "compiled 2 graphs", or "not gc, not a compile" (the rest: a lock waited for, the machine's other load).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

SLOW_FACTOR = 10.0  # a forward this many times the recent median is named in the log


class _GcClock:
    """Milliseconds of garbage collection in this process since it was installed (one callback)."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.total_ms += 1000 * (time.perf_counter() - self._began)
            self._began = None


_GC_CLOCK = _GcClock()


class StepCauses:
    def __init__(self) -> None:
        self._mark = (0.0, 0)

    @staticmethod
    def _num_graphs() -> int:
        """Graphs torch.compile has built in this process (0 until the compiler is loaded)."""
        dynamo = sys.modules.get("torch._dynamo.utils")
        return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0

    def mark(self) -> None:
        self._mark = (_GC_CLOCK.total_ms, self._num_graphs())

    def since_mark(self) -> tuple[float, int]:
        """(gc ms, graphs compiled) since mark()."""
        gc_ms, graphs = self._mark
        return _GC_CLOCK.total_ms - gc_ms, self._num_graphs() - graphs


def slow_cause(duration_ms: float, gc_ms: float, num_compiled: int) -> str:
    """The cause a slow forward's record names."""
    if num_compiled:
        return f"compiled {num_compiled} graph(s) (a shape the compiled body had not seen)"
    if gc_ms >= 0.5 * duration_ms:
        return f"garbage collection {gc_ms:.0f} ms"
    return f"not gc ({gc_ms:.0f} ms), not a compile: a lock waited for, or the machine's other load"
