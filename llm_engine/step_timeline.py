"""The engine's recent forwards, one record each: when it started, how long it took, and what it carried
(decode tokens, prompt tokens). Kept by the model runner in a bounded ring (it outlives a worker's role
changes, as the engine does) and read by the worker actor (`step_timeline()`, `GET
/admin/workers/{id}/steps`): where a stream's gap came from, step by step.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

MAX_STEPS = 4096  # about a few minutes of steps on a CPU


@dataclass(frozen=True)
class StepRecord:
    started: float  # time.time()
    duration_ms: float
    num_decode_tokens: int  # running requests that each computed their newest token
    num_prefill_tokens: int  # prompt tokens (or tokens recomputed after a preemption or a migration)


class StepTimeline:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)

    def record(self, step: StepRecord) -> None:
        self._steps.append(step)  # deque.append is atomic: readers on other threads see whole records

    @property
    def last(self) -> StepRecord | None:
        return self._steps[-1] if self._steps else None

    def since(self, started: float = 0.0) -> list[StepRecord]:
        """The steps that started at or after `started` (time.time()), oldest first."""
        return [s for s in list(self._steps) if s.started >= started]
