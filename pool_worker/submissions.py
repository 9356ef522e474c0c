"""What the actor does with a batch of submissions before a role sees them (submit_batch): the requests
without a grammar submitted at once; the others' grammars compiled off the step loop, concurrently (one that
fails refuses its request alone), then those submitted; sticky aborts (an abort that overtook its submission
refuses it); and each refusal's reason, per request, in the batch's order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from decode_pool.messages import DecodeOutput, DecodeRequest
from llm_engine.structured import GrammarCache, GrammarError, GrammarSpec
from prefill_pool.messages import PrefillRequest, PrefillResult
from worker_runtime.aborted import AbortedIds

RequestT = TypeVar("RequestT", PrefillRequest, DecodeRequest)
GRAMMAR_COMPILE_TIMEOUT_S = 30.0
GRAMMAR_COMPILE_THREADS = 2


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


async def submit_batch(requests: Sequence[RequestT], submit: Callable[[RequestT], None], aborted: AbortedIds,
                       cache: GrammarCache) -> list[str]:
    """submit_each() the requests without a grammar, then, once their grammars are compiled, the others
    (a slow grammar keeps no other request of the batch waiting); the reasons in the batch's order."""
    plain = [i for i, r in enumerate(requests) if r.sampling.grammar is None]
    structured = [i for i, r in enumerate(requests) if r.sampling.grammar is not None]
    reasons = dict(zip(plain, submit_each([requests[i] for i in plain], submit, aborted, {}), strict=True))
    if structured:
        later = [requests[i] for i in structured]
        refused = await compile_grammars(cache, later)
        reasons.update(zip(structured, submit_each(later, submit, aborted, refused), strict=True))
    return [reasons[i] for i in range(len(requests))]


# The worker's own compile threads: a compile that timed out still runs to its end, and holds one of these,
# not a thread of the default executor every other to_thread of the actor shares.
_COMPILERS = ThreadPoolExecutor(GRAMMAR_COMPILE_THREADS, thread_name_prefix="grammar-compile")


async def compile_grammars(cache: GrammarCache, requests: Sequence[PrefillRequest | DecodeRequest]
                           ) -> dict[str, str]:
    """Compile the requests' grammars (cached after the first; held with each request: GrammarCache.hold)
    concurrently, on the worker's compile threads, neither the step loop's (every stream there would wait)
    nor the actor's event loop; a grammar that does not compile, or takes over GRAMMAR_COMPILE_TIMEOUT_S,
    refuses its request alone. Returns the refusals by request id."""
    loop = asyncio.get_running_loop()

    async def compiled(request: PrefillRequest | DecodeRequest, spec: GrammarSpec) -> str:
        try:
            await asyncio.wait_for(loop.run_in_executor(_COMPILERS, cache.hold, spec),
                                   GRAMMAR_COMPILE_TIMEOUT_S)
            return ""
        except GrammarError as error:
            return f"its grammar was refused: {error}"
        except TimeoutError:
            return f"its grammar took over {GRAMMAR_COMPILE_TIMEOUT_S:.0f} s to compile"

    with_grammar = [(r, r.sampling.grammar) for r in requests if r.sampling.grammar is not None]
    reasons = await asyncio.gather(*(compiled(request, spec) for request, spec in with_grammar))
    return {request.request_id: reason for (request, _), reason in zip(with_grammar, reasons, strict=True)
            if reason}
