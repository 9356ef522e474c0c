"""One request's way through both stages, as a stream of typed events, surviving worker failures.
This module decides the route (which decode worker; a local prefill there, or the prefill pool first) and
runs the stages in order; the request's state is state.py (RequestState), its bookings and worker picks
route.py (RequestRoute), the stages prefill_stage.py and decode_stage.py, the events and RequestFailed
events.py. Nothing imports this module but the service and the choices run built on it.

    pick decode worker (its tokens booked there at once, moved with the request, released when it ends)
      → pick prefill worker → PREFILL (through the worker's client, gateway/fleet/worker_client.py:
        submitted batched with the others of this event-loop turn; its result, the first token + KVHandle,
        arrives on that worker's one output stream to this gateway) → event #1
      → DECODE (submitted to the decode worker the same way; it pulls the KV, then generates; its outputs
        arrive on its output stream) → events → final event.
Each submission to a worker goes under an id of its own (RequestState.new_attempt_id()): a worker never
takes a retry for the attempt it aborted or still holds.
A worker that changed role under the request (WrongRoleError) is not a failure: another one is picked.
Failures (a worker's actor died, its step loop died, or it answered with finish_reason "error"):
    PREFILL: the worker is marked failed and the request retried once on another prefill worker.
    DECODE:  the worker is marked failed; the request migrates to another decode worker with the tokens the
             client already has (that worker recomputes prompt + those tokens), and the stream goes on
             without a duplicate or missing token. Up to MAX_MIGRATIONS times. After a failed step that
             computed it (it may be what breaks the steps) it is a suspect: the batch of that step is tried
             again as one group, apart from other requests, halved at each failure of its own, and lifted
             once it has computed a token; a suspect that fails alone is the culprit and ends with an error
             (decode_stage.MAX_FAILED_STEPS bounds the halvings). A worker's own fault (an allocator OOM, a
             dead tensor-parallel rank) makes no suspects.
    With no live worker of the role needed (1P+1D), it waits for the replacement the pool starts, until the
    stage's deadline; then, and whenever a deadline passes, it raises RequestFailed (a clear error).
Clearing: a long prompt that a worker will prefill itself while it decodes streams has those streams moved
    off it first (the router's streams_to_clear; the worker hands them back as an evacuation does).
Evacuation (a decode or mixed worker changing role or leaving hands its requests back, finish "migrate"):
    the stream moves the same way, without marking the worker failed, and where the worker offers the
    stream's KV (kv_handle on its last output: its own, nixl, or the prefill worker's when the pull had not
    started) the next worker pulls it instead of recomputing it;
    a request with no token yet is routed again from the start (to the prefill pool, if the new layout has
    one).
Fleet-closed streams (ChannelClosed: the fleet took this frontend for gone, e.g. while it was paused, and had
    the workers end its streams and abort their requests): no worker is marked failed; the request starts
    again where it was, recomputing prompt + the tokens the client has (a prefill is simply submitted again).
Refusals (a worker will not take the request: a grammar it cannot compile, more KV than it holds): another
    worker of the role takes it if there is one; when none is left, HTTP 400 with code "refused".
Leaving the stream early (client gone, error) aborts the request on whichever workers hold it, and tells the
prefill worker to free a KV handle nobody will pull.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator

from decode_pool.messages import DecodeRequest
from gateway.fleet.worker_errors import WorkerLost
from gateway.fleet.workers import Worker
from gateway.requests import decode_stage, prefill_stage
from gateway.requests.deadlines import DeadlinePolicy, RequestDeadlines
from gateway.requests.events import FailureCode, RequestFailed, StreamEvent
from gateway.requests.route import RequestRoute
from gateway.requests.router import Router
from gateway.requests.state import RequestState
from llm_engine.finish_reason import FinishReason
from llm_engine.params import SamplingParams
from worker_runtime.roles import Role


class RequestRun:
    """Drives one request; `events()` is its stream."""

    def __init__(self, router: Router, request_id: str, prompt_token_ids: tuple[int, ...],
                 sampling: SamplingParams, deadlines: RequestDeadlines,
                 block_hashes: list[bytes] | None = None) -> None:
        self.router = router
        self.state = RequestState(request_id, prompt_token_ids, sampling, deadlines, block_hashes)
        # Booked on its decode worker: the prompt and what it may generate.
        self.route = RequestRoute(router, self.state, self._num_reserved(len(prompt_token_ids), sampling))

    @staticmethod
    def _num_reserved(num_prompt_tokens: int, sampling: SamplingParams) -> int:
        return num_prompt_tokens + sampling.max_tokens

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        state = self.state
        try:
            while True:
                async for event in self._route():
                    yield event
                if not state.is_requeued:
                    return
                # Handed back before its first token: routed again, as if new.
                state.is_requeued = False
                state.num_moves += 1
                state.local_prefill_reason = ""
        finally:
            self.route.release()

    async def _route(self) -> AsyncGenerator[StreamEvent, None]:
        state, route = self.state, self.route
        decode = await route.pick_decode(state.deadlines.prefill_by)
        # A mixed worker prefills its own requests; so does a decode worker when no prefill worker is left
        # (a layout moving to all-mixed drains the prefill pool while decode workers still serve), or when
        # the router finds the handoff not worth it (conditional disaggregation).
        state.local_prefill_reason = (
            "mixed worker" if decode.role is Role.MIXED else
            "no prefill worker" if not route.has_prefill_pool() else
            self.router.local_prefill_reason(state.prompt_token_ids, state.block_hashes)
        )
        if state.local_prefill_reason:
            # Prompt tokens sent to a decode or mixed worker and not yet prefilled (the ratio controller's
            # view of prompt work on workers that also decode).
            await self._clear_for_prompt(decode)  # first: the controller, told next, sees no stream beside it
            request = DecodeRequest(state.new_attempt_id(), state.prompt_token_ids, state.sampling)
            with route.local_prefill(decode, request.request_id):
                async for event in decode_stage.decode_stream(state, route, decode, request):
                    # Its first token came: its prompt is prefilled.
                    self.router.end_local_prefill(decode.worker_id, request.request_id)
                    yield event
            return
        prefill, result = await prefill_stage.prefill(state, route)
        handle = result.kv_handle
        is_pulled = False  # the first decode worker finished the request from the KV it pulled
        try:
            if result.finish_reason == FinishReason.ABORT:  # refused by the worker: no token to send
                yield StreamEvent(state.request_id, (), (), (), FinishReason.ABORT, prefill=result)
                return
            state.generated.append(result.first_token_id)
            logprobs = () if result.first_logprob is None or not state.sampling.logprobs else (
                result.first_logprob,)
            yield StreamEvent(state.request_id, (result.first_token_id,), logprobs, (result.times.finished,),
                              result.finish_reason, (result.first_top_logprobs,) if logprobs else (),
                              result.prompt_logprobs, prefill=result, prefilled_by=prefill.worker_id)
            if result.finish_reason is not None:
                return
            request = DecodeRequest(state.new_attempt_id(), state.prompt_token_ids, state.sampling,
                                    result.first_token_id, result.first_logprob, handle,
                                    first_top_logprobs=result.first_top_logprobs)
            async for event in decode_stage.decode_stream(state, route, decode, request):
                # No bytes pulled: the decode worker recomputed the prompt (its pull failed, or it knew no
                # such peer and so could not tell the sender), and the offer is still held.
                is_pulled = (event.finish_reason is not None and not (state.num_migrations or state.num_moves)
                             and event.decode is not None and event.decode.transfer_bytes > 0)
                yield event
        finally:
            if handle is not None and not is_pulled:
                # The client left, or the decode worker failed, perhaps before it pulled: free the prefill
                # blocks now rather than at the lease's end. A lease already released, or being pulled
                # (claimed), is left alone by the sender, so this is safe whatever the decode side did.
                prefill.client.release_kv(handle.transfer_id, "the request ended or moved on")

    async def _clear_for_prompt(self, host: Worker) -> None:
        """A long prompt about to be prefilled by a worker that decodes streams: move them off it first
        (their runs continue each on another worker, pulling its KV), so that its chunks stall none."""
        state = self.state
        streams = self.router.streams_to_clear(host, len(state.prompt_token_ids))
        if not streams:
            return
        self.route.at(f"moving {len(streams)} streams off {host.worker_id} before its prompt")
        try:
            async with asyncio.timeout(state.time_left(state.deadlines.prefill_by)):
                await host.client.move_out(list(streams))
        except WorkerLost:
            return  # the prompt's own submission will find it gone
        except TimeoutError:
            raise RequestFailed(state.late("prefill", state.deadlines.prefill_by),
                                FailureCode.DEADLINE_EXCEEDED) from None


def run_request(router: Router, request_id: str, prompt_token_ids: tuple[int, ...], sampling: SamplingParams,
                deadlines: RequestDeadlines | None = None, block_hashes: list[bytes] | None = None
                ) -> AsyncGenerator[StreamEvent, None]:
    """The request's events; deadlines default to DeadlinePolicy()'s for a request arriving now;
    `block_hashes`: the prompt's prefix hashes, if computed already (the router computes them otherwise)."""
    if deadlines is None:
        deadlines = DeadlinePolicy().for_request(time.time(), len(prompt_token_ids), sampling.max_tokens)
    return RequestRun(router, request_id, prompt_token_ids, sampling, deadlines, block_hashes).events()
