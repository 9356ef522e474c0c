"""One request's way through both stages, as a stream of typed events.

    pick decode worker → pick prefill worker → prefill (first token + KVHandle) → event #1 at once
      → decode stream (the decode worker pulls the KV, then generates) → events → final event with times.
Closing the stream early (client gone) aborts the request on whichever worker holds it.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import ray

from decode_pool.messages import DecodeOutput, DecodeRequest
from gateway.pools import Worker
from gateway.router import Router
from llm_engine import SamplingParams
from prefill_pool.messages import PrefillRequest, PrefillResult


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    token_ids: tuple[int, ...]  # new tokens
    logprobs: tuple[float, ...]
    emitted_at: float  # wall clock when the worker produced them
    finish_reason: str | None = None
    prefill: PrefillResult | None = None  # on the first event
    decode: DecodeOutput | None = None  # on the final event when the request was decoded


async def run_request(router: Router, request_id: str, prompt_token_ids: tuple[int, ...],
                      sampling: SamplingParams) -> AsyncGenerator[StreamEvent, None]:
    decode = router.pick_decode()
    if decode.is_colocated:
        async for event in _run_colocated(router, decode, request_id, prompt_token_ids, sampling):
            yield event
        return
    prefill = router.pick_prefill(prompt_token_ids)
    num_prompt = len(prompt_token_ids)
    router.prefill_tokens[prefill.worker_id] += num_prompt
    router.decode_tokens[decode.worker_id] += num_prompt + sampling.max_tokens
    stream = None
    is_finished = False
    try:
        prefill_ref = prefill.actor.prefill.remote(PrefillRequest(request_id, prompt_token_ids, sampling))
        try:
            result: PrefillResult = await prefill_ref
        finally:
            router.prefill_tokens[prefill.worker_id] -= num_prompt
        logprobs = () if result.first_logprob is None else (result.first_logprob,)
        first = StreamEvent(request_id, (result.first_token_id,) if result.finish_reason != "abort" else (),
                            logprobs if sampling.logprobs else (), result.times.finished,
                            result.finish_reason, prefill=result)
        yield first
        if result.finish_reason is not None:
            is_finished = True
            return
        stream = decode.actor.generate.remote(DecodeRequest(
            request_id, prompt_token_ids, sampling, result.first_token_id, result.first_logprob,
            result.kv_handle))
        async for event in _decode_events(request_id, stream):
            is_finished = event.finish_reason is not None
            yield event
    finally:
        router.decode_tokens[decode.worker_id] -= num_prompt + sampling.max_tokens
        if not is_finished:
            # The client went away: stop the work wherever it is (both calls are idempotent).
            prefill.actor.abort.remote(request_id)
            decode.actor.abort.remote(request_id)
            if stream is not None:
                ray.cancel(stream)


async def _run_colocated(router: Router, worker: Worker, request_id: str, prompt_token_ids: tuple[int, ...],
                         sampling: SamplingParams) -> AsyncGenerator[StreamEvent, None]:
    """The colocated baseline: one worker prefills (chunks mixed into its decode steps) and decodes."""
    reserved = len(prompt_token_ids) + sampling.max_tokens
    router.decode_tokens[worker.worker_id] += reserved
    stream = worker.actor.generate.remote(DecodeRequest(request_id, prompt_token_ids, sampling))
    is_finished = False
    try:
        async for event in _decode_events(request_id, stream):
            is_finished = event.finish_reason is not None
            yield event
    finally:
        router.decode_tokens[worker.worker_id] -= reserved
        if not is_finished:
            worker.actor.abort.remote(request_id)
            ray.cancel(stream)


async def _decode_events(request_id: str, stream: Any) -> AsyncGenerator[StreamEvent, None]:
    """A decode actor's Ray stream of DecodeOutputs as StreamEvents (the last one carries the outputs)."""
    async for ref in stream:
        output: DecodeOutput = await ref
        is_finished = output.finish_reason is not None
        yield StreamEvent(request_id, output.token_ids, output.logprobs, output.emitted_at,
                          output.finish_reason, decode=output if is_finished else None)
