"""One request's way through both stages, as a stream of typed events, surviving worker failures.
This module owns the route (which decode worker; a local prefill there, or the prefill pool first), the
request's booking and counters and the waits for a worker; the stages are prefill_stage.py and
decode_stage.py, the events and RequestFailed events.py.

    pick decode worker (its tokens booked there at once, moved with the request, released when it ends)
      → pick prefill worker → PREFILL (through the worker's client, gateway/fleet/worker_client.py:
        submitted batched with the others of this event-loop turn; its result, the first token + KVHandle,
        arrives on that worker's one output stream to this gateway) → event #1
      → DECODE (submitted to the decode worker the same way; it pulls the KV, then generates; its outputs
        arrive on its output stream) → events → final event.
A worker that changed role under the request (WrongRoleError) is not a failure: another one is picked.
Failures (a worker's actor died, its step loop died, or it answered with finish_reason "error"):
    PREFILL: the worker is marked failed and the request retried once on another prefill worker.
    DECODE:  the worker is marked failed; the request migrates to another decode worker with the tokens the
             client already has (that worker recomputes prompt + those tokens), and the stream goes on
             without a duplicate or missing token. Up to MAX_MIGRATIONS times, and at most once after a
             failed step that computed it (it may be what breaks the steps: MAX_FAILED_STEPS); after such a
             step it is a suspect, computed alone on the next worker, so that a second failure is its own
             and an innocent request that shared the first batch is never failed for it.
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
from gateway.requests.events import RequestFailed, StreamEvent
from gateway.requests.router import Router
from llm_engine.params import SamplingParams
from worker_runtime.roles import Role

WORKER_POLL_S = 0.1  # while waiting for a replacement worker


class RequestRun:
    """Drives one request; `events()` is its stream."""

    def __init__(self, router: Router, request_id: str, prompt_token_ids: tuple[int, ...],
                 sampling: SamplingParams, deadlines: RequestDeadlines,
                 block_hashes: list[bytes] | None = None) -> None:
        self.router = router
        self.block_hashes = block_hashes  # the prompt's prefix hashes, when the gateway computed them
        self.fleet = router.fleet
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.deadlines = deadlines
        self.generated: list[int] = []  # every token the client has been sent
        self.num_migrations = 0  # moves forced by failed decode workers
        self.num_moves = 0  # moves because a decode worker changed role or left (not failures)
        self.num_failed_steps = 0  # decode workers whose failing step had this request in its batch
        self.local_prefill_reason = ""  # why the decode worker prefilled the prompt; empty: the prefill pool
        self.num_reserved = len(prompt_token_ids) + sampling.max_tokens  # booked on its decode worker
        self._booked: str | None = None  # the decode worker holding that booking

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        try:
            while True:
                try:
                    async for event in self._route():
                        yield event
                    return
                except decode_stage.Requeued:  # handed back before its first token: routed again, as if new
                    self.num_moves += 1
                    self.local_prefill_reason = ""
        finally:
            self.book(None)

    def at(self, stage: str) -> None:
        """Where the request is now ("waiting for a prefill worker", "decoding on worker-2"): a drain that
        waits for its booking says so."""
        self.router.stages[self.request_id] = stage

    def book(self, decode: Worker | None) -> None:
        """Move the request's decode booking to `decode` (None: release it, and forget its stage)."""
        worker_id = decode.worker_id if decode is not None else None
        if worker_id is None:
            self.router.stages.pop(self.request_id, None)
        if worker_id == self._booked:
            return
        if self._booked is not None:
            self.router.unbook_decode(self._booked, self.num_reserved, self.request_id)
        if worker_id is not None:
            self.router.book_decode(worker_id, self.num_reserved, self.request_id)
        self._booked = worker_id

    async def pick_decode(self, deadline: float, exclude: set[str] | None = None) -> Worker:
        decode = await self.wait_for_worker("decode", deadline, exclude, is_new=not self.generated)
        self.book(decode)
        return decode

    async def _route(self) -> AsyncGenerator[StreamEvent, None]:
        decode = await self.pick_decode(self.deadlines.prefill_by)
        has_prefill_pool = (self.fleet.active(Role.PREFILL) or self.fleet.is_replacing(Role.PREFILL)
                            or self.is_prefill_coming())
        # A mixed worker prefills its own requests; so does a decode worker when no prefill worker is left
        # (a layout moving to all-mixed drains the prefill pool while decode workers still serve), or when
        # the router finds the handoff not worth it (conditional disaggregation).
        self.local_prefill_reason = (
            "mixed worker" if decode.role is Role.MIXED else
            "no prefill worker" if not has_prefill_pool else
            self.router.local_prefill_reason(self.prompt_token_ids, self.block_hashes)
        )
        if self.local_prefill_reason:
            # Prompt tokens sent to a decode or mixed worker and not yet prefilled (the ratio controller's
            # view of prompt work on workers that also decode).
            await self._clear_for_prompt(decode)  # first: the controller, told next, sees no stream beside it
            self.router.start_local_prefill(decode.worker_id, self.request_id, len(self.prompt_token_ids))
            try:
                request = DecodeRequest(self.request_id, self.prompt_token_ids, self.sampling)
                async for event in decode_stage.decode_stream(self, decode, request):
                    self.router.end_local_prefill(decode.worker_id, self.request_id)  # its first token came
                    yield event
            finally:
                self.router.end_local_prefill(decode.worker_id, self.request_id)
            return
        prefill, result = await prefill_stage.prefill(self)
        handle = result.kv_handle
        is_pulled = False  # the first decode worker finished the request from the KV it pulled
        try:
            if result.finish_reason == "abort":  # refused by the worker: no token to send
                yield StreamEvent(self.request_id, (), (), (), "abort", prefill=result)
                return
            self.generated.append(result.first_token_id)
            logprobs = () if result.first_logprob is None or not self.sampling.logprobs else (
                result.first_logprob,)
            yield StreamEvent(self.request_id, (result.first_token_id,), logprobs, (result.times.finished,),
                              result.finish_reason, (result.first_top_logprobs,) if logprobs else (),
                              result.prompt_logprobs, prefill=result, prefilled_by=prefill.worker_id)
            if result.finish_reason is not None:
                return
            request = DecodeRequest(self.request_id, self.prompt_token_ids, self.sampling,
                                    result.first_token_id, result.first_logprob, handle,
                                    first_top_logprobs=result.first_top_logprobs)
            async for event in decode_stage.decode_stream(self, decode, request):
                # No bytes pulled: the decode worker recomputed the prompt (its pull failed, or it knew no
                # such peer and so could not tell the sender), and the offer is still held.
                is_pulled = (event.finish_reason is not None and not (self.num_migrations or self.num_moves)
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
        streams = self.router.streams_to_clear(host, len(self.prompt_token_ids))
        if not streams:
            return
        self.at(f"moving {len(streams)} streams off {host.worker_id} before its prompt")
        try:
            async with asyncio.timeout(self.time_left(self.deadlines.prefill_by)):
                await host.client.move_out(list(streams))
        except WorkerLost:
            return  # the prompt's own submission will find it gone
        except TimeoutError:
            raise RequestFailed(self.late("prefill", self.deadlines.prefill_by), "deadline_exceeded"
                                ) from None

    async def wait_for_worker(self, role: str, deadline: float, exclude: set[str] | None = None,
                               is_new: bool = False) -> Worker:
        """The router's pick among live workers not in `exclude`; waits for a replacement until `deadline`.
        `is_new`: a decode worker for a request with no token yet (its prompt may be prefilled there)."""
        while True:
            roles = (Role.DECODE, Role.MIXED) if role == "decode" else (Role.PREFILL,)
            candidates = [w for w in self.fleet.active(*roles) if w.worker_id not in (exclude or ())]
            if candidates:
                num_prompt = len(self.prompt_token_ids) if is_new else 0
                return (self.router.pick_decode(candidates, num_prompt) if role == "decode"
                        else self.router.pick_prefill(self.prompt_token_ids, candidates, self.block_hashes))
            self.at(f"waiting for a {role} worker")
            if not (self.fleet.is_replacing(*roles) or self._is_role_coming(roles)):
                raise RequestFailed(f"no {role} worker is alive and none is starting", "no_worker")
            if self.time_left(deadline) <= 0:
                raise RequestFailed(f"no {role} worker became available before the request's deadline",
                                    "no_worker")
            await asyncio.sleep(WORKER_POLL_S)

    def _is_role_coming(self, roles: tuple[Role, ...]) -> bool:
        """Whether a worker is changing role into one of `roles` (it will be routable shortly)."""
        return any(w.next_role in roles for w in self.fleet.workers.values())

    def is_prefill_coming(self) -> bool:
        return self._is_role_coming((Role.PREFILL,))

    @staticmethod
    def time_left(deadline: float) -> float:
        return max(0.0, deadline - time.time())

    def late(self, stage: str, deadline: float) -> str:
        budget = deadline - self.deadlines.arrival
        return f"the request passed its deadline in the {stage} stage ({budget:.1f} s after arrival)"



def run_request(router: Router, request_id: str, prompt_token_ids: tuple[int, ...], sampling: SamplingParams,
                deadlines: RequestDeadlines | None = None, block_hashes: list[bytes] | None = None
                ) -> AsyncGenerator[StreamEvent, None]:
    """The request's events; deadlines default to DeadlinePolicy()'s for a request arriving now;
    `block_hashes`: the prompt's prefix hashes, if computed already (the router computes them otherwise)."""
    if deadlines is None:
        deadlines = DeadlinePolicy().for_request(time.time(), len(prompt_token_ids), sampling.max_tokens)
    return RequestRun(router, request_id, prompt_token_ids, sampling, deadlines, block_hashes).events()
