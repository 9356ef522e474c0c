"""What the request path answers its caller: a stream of StreamEvent, or RequestFailed (gateway/requests/
orchestrator.py drives a request through both stages; prefill_stage.py and decode_stage.py are its stages)."""

from __future__ import annotations

from dataclasses import dataclass

from decode_pool.messages import DecodeOutput
from llm_engine.params import PromptLogprobs, TopLogprobs
from prefill_pool.messages import PrefillResult


class RequestFailed(Exception):
    """The request cannot finish; the message is safe to show the client (no internals)."""

    def __init__(self, message: str, code: str, status: int = 503) -> None:
        super().__init__(message)
        self.code = code  # "worker_failed", "no_worker", "deadline_exceeded" or "refused"
        self.status = status  # HTTP: 503 (try again), or 400 for a request no worker will ever take



@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    token_ids: tuple[int, ...]  # new tokens
    logprobs: tuple[float, ...]
    token_times: tuple[float, ...]  # worker wall clock when each token was produced
    finish_reason: str | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None  # on the first token's event, when asked for
    prefill: PrefillResult | None = None  # on the first event
    decode: DecodeOutput | None = None  # on the final event when the request was decoded
    num_migrations: int = 0  # decode workers left behind because they failed (final event)
    num_moves: int = 0  # decode workers left because they changed role or left the pools (final event)
    local_prefill_reason: str = ""  # why the decode worker prefilled the prompt itself (final event)
    # The worker that prefilled the prompt: a prefill worker (first event) or the decode worker itself
    # (final event), for the prefix-cache metrics.
    prefilled_by: str = ""
    index: int = 0  # the choice (n > 1: gateway/requests/choices.py)
