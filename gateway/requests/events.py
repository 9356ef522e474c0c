"""What the request path answers its caller: a stream of StreamEvent, or RequestFailed (gateway/requests/
orchestrator.py drives a request through both stages; prefill_stage.py and decode_stage.py are its stages)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from decode_pool.messages import DecodeOutput
from llm_engine.finish_reason import FinishReason
from llm_engine.params import PromptLogprobs, TopLogprobs
from prefill_pool.messages import PrefillResult


class FailureCode(enum.StrEnum):
    """Why a request could not finish, as the client's error object names it."""

    WORKER_FAILED = "worker_failed"  # the workers that served it failed (more than it may move across)
    NO_WORKER = "no_worker"  # no worker of a role it needs is alive, or none came before its deadline
    DEADLINE_EXCEEDED = "deadline_exceeded"
    REFUSED = "refused"  # no worker will take it (a grammar none compiles, more KV than any holds): a 400
    SHUTTING_DOWN = "shutting_down"  # the server stops: send it again
    FLEET_UNAVAILABLE = "fleet_unavailable"  # the fleet actor restarts (several frontends)


class RequestFailed(Exception):
    """The request cannot finish; the message is safe to show the client (no internals)."""

    def __init__(self, message: str, code: FailureCode, status: int = 503) -> None:
        super().__init__(message)
        self.code = code
        self.status = status  # HTTP: 503 (try again), or 400 for a request no worker will ever take



@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    token_ids: tuple[int, ...]  # new tokens
    logprobs: tuple[float, ...]
    token_times: tuple[float, ...]  # worker wall clock when each token was produced
    finish_reason: FinishReason | None = None
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
