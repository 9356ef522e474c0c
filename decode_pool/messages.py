"""What goes into a decode worker and what streams out of it (typed, frozen; pickled through Ray)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kv_transfer import KVHandle
from llm_engine.choices import FirstToken, choice_request_id
from llm_engine.finish_reason import FinishReason
from llm_engine.params import PromptLogprobs, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str  # minted by the gateway, the same on both stages
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams  # the whole request's parameters (max_tokens counts the first token)
    # The prefill worker's first token and the handle to its prompt KV. Both None: this worker prefills
    # the prompt itself (the mixed role) and streams the first token too.
    first_token_id: int | None = None
    first_logprob: float | None = None
    kv_handle: KVHandle | None = None
    # Tokens the client already has from an earlier worker (migration): this worker continues after them.
    # With kv_handle (the earlier worker evacuated the stream and offers its KV), the KV of prompt + all
    # but the last of these is pulled; without, recomputed (the earlier worker failed). Empty when new.
    generated_token_ids: tuple[int, ...] = ()
    first_top_logprobs: TopLogprobs = ()  # the prefill worker's first token's alternatives, when asked
    # sampling.n > 1: the choices that decode on from kv_handle's prompt, with their first tokens (the
    # first_* fields above are unused then). The KV is pulled once; then each choice runs as a request of
    # its own, forked from the pulled blocks, under choice_request_id(request_id, index) with
    # sampling.for_choice(index): its outputs, its abort, its migration (llm_engine/choices.py).
    choices: tuple[FirstToken, ...] = ()
    # It was in the batch of a decode step that failed on another worker: the gateway's name for its group of
    # suspects, which compute apart from every other request here until each has sampled a token (a second
    # failure then blames that group only); "": not a suspect.
    suspect_group: str = ""

    @property
    def output_request_ids(self) -> tuple[str, ...]:
        """The ids this request's outputs stream under: its own, or each choice's."""
        if not self.choices:
            return (self.request_id,)
        return tuple(choice_request_id(self.request_id, c.index) for c in self.choices)


@dataclass(frozen=True)
class DecodeTimes:
    """Wall-clock times (time.time()) on the decode worker; None for a stage the request skipped."""

    queued: float  # the request reached the worker
    transfer_started: float | None  # blocks allocated, pull started
    transfer_finished: float | None  # pull DONE (or FAILED, then the prompt is recomputed here)
    admitted: float | None  # joined the running batch
    finished: float


@dataclass(frozen=True)
class DecodeOutput:
    """One step's tokens for one request; the last one carries finish_reason and the stage times."""

    request_id: str
    token_ids: tuple[int, ...]  # new tokens (one per step; none in a final abort/error output)
    logprobs: tuple[float, ...]  # their log-probabilities, when asked for
    emitted_at: float  # wall clock when the step produced the last of them
    token_times: tuple[float, ...] = ()  # wall clock when each token was produced (several once coalesced)
    finish_reason: FinishReason | None = None  # set on the last output
    times: DecodeTimes | None = None  # on the final output
    transfer_bytes: int = 0  # KV bytes pulled for this request (final output)
    num_preemptions: int = 0  # times recomputed after losing its blocks (final output)
    num_cached_tokens: int = 0  # prompt tokens this worker found in its prefix cache (final output)
    error: str = ""  # why, when finish_reason is "error"
    # finish_reason "error": the request was in the batch whose step raised, so it may be what broke the
    # worker (a "query of death"). Never set when the worker's own fault broke the step (an allocator OOM, a
    # collective that failed: llm_engine/step_faults.py).
    in_failed_step: bool = False
    failed_step_id: str = ""  # with in_failed_step: names that step (the gateway's suspect group)
    num_in_failed_step: int = 0  # with in_failed_step: how many requests that step computed (1: it alone)
    # finish_reason "migrate": the stream's KV (prompt + tokens so far but the last), offered by this worker
    # for the next one to pull; None: the next worker recomputes it.
    kv_handle: KVHandle | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when sampling.top_logprobs > 0
    # On the first output when this worker prefilled the prompt and sampling.prompt_logprobs is set.
    prompt_logprobs: PromptLogprobs | None = None


def coalesce(outputs: list[DecodeOutput]) -> DecodeOutput:
    """Several queued outputs of one request as one (a slow reader gets them in one stream item)."""
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    return dataclasses.replace(
        last,
        token_ids=tuple(t for o in outputs for t in o.token_ids),
        logprobs=tuple(lp for o in outputs for lp in o.logprobs),
        top_logprobs=tuple(top for o in outputs for top in o.top_logprobs),
        prompt_logprobs=next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None),
        token_times=tuple(t for o in outputs for t in o.token_times),
    )
