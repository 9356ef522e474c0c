"""What goes into a prefill worker and what comes out of it (typed, frozen; pickled through Ray)."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer import KVHandle
from llm_engine.choices import FirstToken
from llm_engine.finish_reason import FinishReason
from llm_engine.params import PromptLogprobs, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str  # minted by the gateway, the same on both stages
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # the whole request's parameters (max_tokens counts the first token)


@dataclass(frozen=True)
class PrefillTimes:
    """Wall-clock times (time.time()) on the prefill worker."""

    queued: float  # the request reached the worker
    started: float  # its first chunk was scheduled
    finished: float  # its first token was sampled (and its KV offered)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first_token_id: int  # -1 when aborted
    first_logprob: float | None  # when the request asked for logprobs
    # Set when the request needs no decode: "stop" (EOS or stop token first), "length" (max_tokens 1),
    # "abort", "error" (the worker failed; see `error`). None means: decode continues from kv_handle.
    finish_reason: FinishReason | None
    kv_handle: KVHandle | None  # the prompt's KV, offered under a lease; None when finished here
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    times: PrefillTimes
    error: str = ""  # why, when finish_reason is "error"
    first_top_logprobs: TopLogprobs = ()  # the first token's alternatives, when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None  # when sampling.prompt_logprobs is set
    # sampling.n > 1: choices 1..n-1's first tokens, each with its own finish_reason (the fields above are
    # choice 0's); kv_handle is then set while any choice decodes on.
    other_choices: tuple[FirstToken, ...] = ()

    @property
    def choices(self) -> tuple[FirstToken, ...]:
        """Every choice's first token, choice 0's first."""
        first = FirstToken(0, self.first_token_id, self.first_logprob, self.first_top_logprobs,
                           self.finish_reason)
        return (first, *self.other_choices)
