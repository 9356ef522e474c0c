"""Every request gets deadlines derived from its own size, so that no stage can hold it forever.

    prefill_by = admitted + slack + prompt tokens × prefill_s_per_token  (prefill queue + prefill)
    finish_by  = prefill_by + slack + max_tokens × decode_s_per_token     (transfer, decode queue, decode)
The wait for admission is not charged to the prefill: it has its own bound (the admission line's timeout),
and a request admitted late in that wait would otherwise fail after using prefill capacity.
The KV transfer has its own, shorter bound (kv_transfer's transfer timeout and lease); a failed pull falls
back to recomputation inside the decode stage. The slack covers queueing and the start of a replacement
worker after a failure. A request that passes a deadline ends with a clear error and frees everything.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    """How deadlines grow with a request (the defaults are generous: they catch hangs, not slow steps)."""

    slack_s: float = 60.0  # every stage's allowance for queueing and for a worker replacement
    prefill_s_per_token: float = 0.02  # 50 prompt tokens/s: far below any worker's prefill rate
    decode_s_per_token: float = 1.0  # one output token a second: far below any worker's decode rate

    def __post_init__(self) -> None:
        if self.slack_s <= 0 or self.prefill_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError(f"deadline policy needs slack_s > 0 and per-token times >= 0, got {self}")

    def for_request(self, arrival: float, num_prompt_tokens: int, max_tokens: int,
                    admitted: float | None = None) -> RequestDeadlines:
        """`admitted`: when the request left the admission line (default: at arrival)."""
        start = arrival if admitted is None else max(arrival, admitted)
        prefill_by = start + self.slack_s + num_prompt_tokens * self.prefill_s_per_token
        finish_by = prefill_by + self.slack_s + max_tokens * self.decode_s_per_token
        return RequestDeadlines(arrival, prefill_by, finish_by)


@dataclass(frozen=True)
class RequestDeadlines:
    """Wall-clock times (time.time()) on the gateway."""

    arrival: float  # the gateway received the request
    prefill_by: float  # the first token must exist by then
    finish_by: float  # the last token must exist by then
