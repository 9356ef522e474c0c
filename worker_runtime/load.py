"""What a worker reports about its load, for the router and the pool manager.

The worker's loop thread builds one after every step and publishes it whole; other threads only read the
latest one, so a report never iterates the scheduler's queues while the loop mutates them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_runtime.roles import Role


@dataclass(frozen=True)
class StepTokens:
    """A histogram of tokens per forward since the worker's engine started (vLLM's iteration_tokens_total)."""

    bounds: tuple[int, ...] = ()  # the buckets' upper bounds (llm_engine/step_timeline.py's), +Inf implied
    bucket_counts: tuple[int, ...] = ()  # forwards per bucket (not cumulative), the +Inf bucket last
    num_tokens: int = 0  # the sum
    num_steps: int = 0  # the count


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    role: Role  # the actor sets MIXED on a decode worker serving mixed
    num_waiting: int  # requests queued, not yet computing
    num_queued_prompt_tokens: int  # prompt tokens still to prefill (queued + partly chunked)
    num_running: int  # requests holding blocks and computing
    num_transferring: int  # KV handoffs in flight (offered on prefill, pulling on decode)
    num_free_blocks: int
    num_total_blocks: int
    num_outstanding_tokens: int  # decode: output tokens still to generate for admitted requests
    failure: str = ""  # why the worker's step loop died; empty while it serves
    # Requests the worker holds in any state (inbox, waiting, prefilling, offered or pulling KV, decoding):
    # a draining worker may stop only at 0.
    num_requests: int = 0
    # The watchdog's inputs (filled by the actor when asked, not by the loop that may be stuck): how long the
    # step now running has run (0: between steps), and the longest step that finished.
    step_running_s: float = 0.0
    longest_step_s: float = 0.0
    # Tokens per forward since the engine started (vLLM's iteration_tokens_total), likewise from the actor.
    step_tokens: StepTokens = field(default_factory=StepTokens)
    # How the model body runs now (llm_engine/compilation.py's CompileReport.mode and why), from the actor:
    # "compiling" turns "compiled" once a body compiled beside serving is swapped in. Empty: not told.
    compile: str = ""
    compile_reason: str = ""

    @property
    def kv_occupancy(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks
