"""What the actor does with a batch of submissions before a role sees them: sticky aborts (an abort that
overtook its submission refuses it), grammars compiled off the step loop (one that fails refuses its request
alone), and each refusal's reason, per request, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TypeVar

from decode_pool.messages import DecodeOutput, DecodeRequest
from llm_engine.structured import GrammarCache, GrammarError
from prefill_pool.messages import PrefillRequest, PrefillResult
from worker_runtime.aborted import AbortedIds

RequestT = TypeVar("RequestT", PrefillRequest, DecodeRequest)
GRAMMAR_COMPILE_TIMEOUT_S = 30.0


def is_final(output: PrefillResult | DecodeOutput) -> bool:
    """A prompt's result is its only output on a prefill worker; a decode output is final when finished."""
    return isinstance(output, PrefillResult) or output.finish_reason is not None


def submit_each(requests: Sequence[RequestT], submit: Callable[[RequestT], None], aborted: AbortedIds,
                refused: dict[str, str]) -> list[str]:
    """submit() each request; per request, why it was refused (`refused`'s reason, its ValueError's message,
    or an abort that came first) or ""."""
    refusals = []
    for request in requests:
        # A group of choices (n > 1) is aborted under its choices' ids: any of them refuses the group (the
        # gateway starts each choice again on its own), and every remembered id is forgotten.
        output_ids: tuple[str, ...] = getattr(request, "output_request_ids", ())
        if [i for i in {request.request_id, *output_ids} if aborted.take(i)]:
            refusals.append(f"{request.request_id} was aborted before it arrived")
            continue
        if request.request_id in refused:
            refusals.append(refused[request.request_id])
            continue
        try:
            submit(request)
            refusals.append("")
        except ValueError as error:
            refusals.append(str(error))
    return refusals


async def compile_grammars(cache: GrammarCache, requests: Sequence[PrefillRequest | DecodeRequest]
                           ) -> dict[str, str]:
    """Compile each request's grammar (cached after the first) on a thread, neither the step loop's (every
    stream there would wait) nor the actor's event loop; a grammar that does not compile, or takes over
    GRAMMAR_COMPILE_TIMEOUT_S, refuses its request alone. Returns the refusals by request id."""
    refused = {}
    for request in requests:
        spec = request.sampling.grammar
        if spec is None:
            continue
        try:
            await asyncio.wait_for(asyncio.to_thread(cache.compile, spec), GRAMMAR_COMPILE_TIMEOUT_S)
        except GrammarError as error:
            refused[request.request_id] = f"its grammar was refused: {error}"
        except TimeoutError:
            refused[request.request_id] = (f"its grammar took over {GRAMMAR_COMPILE_TIMEOUT_S:.0f} s "
                                           "to compile")
    return refused
