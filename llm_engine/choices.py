"""Several choices of one prompt (OpenAI's `n`): one prefill, n first tokens drawn from the same logits,
then n streams that decode from forked blocks (the prompt's full blocks shared by reference, the last partial
block copied: KVCacheManager.fork).

A choice is a request of its own once it has its first token: its id is choice_request_id(request_id, i) and
its parameters are SamplingParams.for_choice(i) (n = 1, its own seed), so every later stage (decode, a
migration to a third worker, recomputation after preemption or failure) treats it as any other request.
Choice 0 keeps the request's own seed (sampling.choice_seed): with a seed, n = 1 equals choice 0 of n > 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_engine.finish_reason import FinishReason
from llm_engine.params import TopLogprobs

MAX_CHOICES = 16  # choices one request may ask for (the gateway refuses more: 400 naming `n`)
_SEPARATOR = "~c"  # request ids are the gateway's ("req-<hex>"): this never occurs in one


def choice_request_id(request_id: str, index: int) -> str:
    """The id choice `index` of `request_id` runs under once it decodes on its own."""
    return f"{request_id}{_SEPARATOR}{index}"


@dataclass(frozen=True)
class FirstToken:
    """One choice's first token, drawn on the worker that prefilled the prompt."""

    index: int  # the choice (0..n-1)
    token_id: int
    logprob: float | None  # when the request asked for logprobs
    top_logprobs: TopLogprobs = ()  # when it asked for top_logprobs
    # "stop" (EOS or a stop token), "length" (max_tokens 1), or None: the choice decodes on.
    finish_reason: FinishReason | None = None
