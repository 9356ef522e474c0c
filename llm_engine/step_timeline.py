"""The engine's recent forwards, one record each: when it started, how long it took, and what it carried
(decode tokens, prompt tokens). Kept by the model runner in a bounded ring (it outlives a worker's role
changes, as the engine does) and read by the worker actor (`step_timeline()`, `GET
/admin/workers/{id}/steps`): where a stream's gap came from, step by step.

Every forward also counts in a histogram of tokens per step since the engine started (vLLM's
iteration_tokens_total, with its buckets), which the worker's load report carries to the gateway's /metrics.
"""

from __future__ import annotations

import bisect
import collections
from dataclasses import dataclass

MAX_STEPS = 4096  # about a few minutes of steps on a CPU
# vLLM's buckets for tokens per engine step (vllm/v1/metrics/buckets.py ITERATION_TOKENS_BUCKETS).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class StepRecord:
    started: float  # time.time()
    duration_ms: float
    num_decode_tokens: int  # running requests that each computed their newest token
    num_prefill_tokens: int  # prompt tokens (or tokens recomputed after a preemption or a migration)
    gc_ms: float = 0.0  # garbage collection in the process meanwhile (llm_engine/step_causes.py)
    num_compiled: int = 0  # graphs torch.compile built meanwhile
    slow_cause: str = ""  # over SLOW_FACTOR × the recent median: why, as far as the worker can tell


@dataclass(frozen=True)
class StepTokenCounts:
    """Tokens per forward since the engine started, as a histogram over STEP_TOKEN_BUCKETS."""

    bucket_counts: tuple[int, ...] = (0,) * (len(STEP_TOKEN_BUCKETS) + 1)  # per bucket, not cumulative; +Inf
    num_tokens: int = 0  # the sum
    num_steps: int = 0  # the count


class StepTimeline:
    def __init__(self, max_steps: int = MAX_STEPS) -> None:
        self._steps: collections.deque[StepRecord] = collections.deque(maxlen=max_steps)
        self._counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        # Replaced whole after each forward: a reader on another thread sees counts, sum and count agree.
        self.tokens = StepTokenCounts()

    def median_ms(self, last: int = 64) -> float | None:
        """The median duration of the last `last` forwards (None before any)."""
        steps = self._steps
        recent = sorted(steps[-i].duration_ms for i in range(1, min(last, len(steps)) + 1))
        return recent[len(recent) // 2] if recent else None

    def record(self, step: StepRecord) -> None:
        self._steps.append(step)  # deque.append is atomic: readers on other threads see whole records
        num_tokens = step.num_decode_tokens + step.num_prefill_tokens
        self._counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, num_tokens)] += 1
        self.tokens = StepTokenCounts(tuple(self._counts), self.tokens.num_tokens + num_tokens,
                                 self.tokens.num_steps + 1)

    @property
    def last(self) -> StepRecord | None:
        return self._steps[-1] if self._steps else None

    def since(self, started: float = 0.0) -> list[StepRecord]:
        """The steps that started at or after `started` (time.time()), oldest first."""
        return [s for s in list(self._steps) if s.started >= started]
