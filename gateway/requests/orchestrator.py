"""One request's way through both stages, as a stream of typed events, surviving worker failures.

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
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from decode_pool.messages import DecodeOutput, DecodeRequest
from gateway.fleet.output_streams import RequestOutputs
from gateway.fleet.worker_errors import ChannelClosed, SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests.deadlines import DeadlinePolicy, RequestDeadlines
from gateway.requests.router import Router
from kv_transfer import KVHandle
from llm_engine import PromptLogprobs, SamplingParams, TopLogprobs
from prefill_pool.messages import PrefillRequest, PrefillResult
from worker_runtime.roles import Role

T = TypeVar("T")
MAX_PREFILL_ATTEMPTS = 2  # the first try and one retry on another worker
MAX_MIGRATIONS = 3  # decode workers a request may move across before it ends with an error
# Workers a request may see fail in a step that computed it: a request that broke one worker's forward may
# be what breaks every forward it is in (a "query of death"): it gets one more worker, then an error.
MAX_FAILED_STEPS = 2
WORKER_POLL_S = 0.1  # while waiting for a replacement worker


class RequestFailed(Exception):
    """The request cannot finish; the message is safe to show the client (no internals)."""

    def __init__(self, message: str, code: str, status: int = 503) -> None:
        super().__init__(message)
        self.code = code  # "worker_failed", "no_worker", "deadline_exceeded" or "refused"
        self.status = status  # HTTP: 503 (try again), or 400 for a request no worker will ever take


class _WorkerLost(Exception):
    """A worker failed while holding this request (internal: triggers a retry or a migration)."""

    def __init__(self, message: str, in_failed_step: bool = False) -> None:
        super().__init__(message)
        self.in_failed_step = in_failed_step  # the request was in the batch whose step raised


class _Evacuated(Exception):
    """The decode worker is changing role or leaving and handed the request back, or the fleet closed the
    stream carrying it (internal: it migrates, and the worker is not marked failed)."""

    def __init__(self, kv_handle: KVHandle | None, may_stay: bool = False) -> None:
        super().__init__("evacuated")
        self.kv_handle = kv_handle  # the stream's KV, offered by the worker it left; None: recompute it
        self.may_stay = may_stay  # the worker serves on (a closed stream): it may take the request again


class _Misrouted(Exception):
    """The decode worker no longer decodes (it changed role after it was picked): pick another (internal)."""


class _Refused(Exception):
    """The decode worker refused the request (internal: another one may take it; none: a 400)."""


class _Requeued(Exception):
    """A request handed back before its first token (internal: it is routed again from the start, so a
    long prompt goes to the prefill pool rather than to whichever decode worker takes the stream)."""


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
                except _Requeued:  # handed back before its first token: route it again, as if it just came
                    self.num_moves += 1
                    self.local_prefill_reason = ""
        finally:
            self._book(None)

    def _book(self, decode: Worker | None) -> None:
        """Move the request's decode booking to `decode` (None: release it)."""
        worker_id = decode.worker_id if decode is not None else None
        if worker_id == self._booked:
            return
        if self._booked is not None:
            self.router.unbook_decode(self._booked, self.num_reserved)
        if worker_id is not None:
            self.router.book_decode(worker_id, self.num_reserved)
        self._booked = worker_id

    async def _pick_decode(self, deadline: float, exclude: set[str] | None = None) -> Worker:
        decode = await self._wait_for_worker("decode", deadline, exclude, is_new=not self.generated)
        self._book(decode)
        return decode

    async def _route(self) -> AsyncGenerator[StreamEvent, None]:
        decode = await self._pick_decode(self.deadlines.prefill_by)
        has_prefill_pool = (self.fleet.active(Role.PREFILL) or self.fleet.is_replacing(Role.PREFILL)
                            or self._is_prefill_coming())
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
                async for event in self._decode(decode, DecodeRequest(self.request_id, self.prompt_token_ids,
                                                                      self.sampling)):
                    self.router.end_local_prefill(decode.worker_id, self.request_id)  # its first token came
                    yield event
            finally:
                self.router.end_local_prefill(decode.worker_id, self.request_id)
            return
        prefill, result = await self._prefill()
        handle = result.kv_handle
        is_pulled = False  # the first decode worker finished the request, so it had pulled the KV
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
            async for event in self._decode(decode, request):
                is_pulled = event.finish_reason is not None and not (self.num_migrations or self.num_moves)
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
        try:
            await host.client.move_out(list(streams))
        except WorkerLost:
            return  # the prompt's own submission will find it gone

    async def _prefill(self) -> tuple[Worker, PrefillResult]:
        tried: set[str] = set()
        num_prompt = len(self.prompt_token_ids)
        for _ in range(MAX_PREFILL_ATTEMPTS):
            prefill = await self._wait_for_worker("prefill", self.deadlines.prefill_by, tried)
            tried.add(prefill.worker_id)
            self.router.prefill_tokens[prefill.worker_id] += num_prompt
            client = prefill.client
            try:
                outputs = client.subscribe(self.request_id)  # before submitting: no result unheard
            except WorkerLost:
                continue  # it left the deployment since it was picked
            try:
                async with asyncio.timeout(self._left(self.deadlines.prefill_by)):
                    await client.submit_prefill(PrefillRequest(self.request_id, self.prompt_token_ids,
                                                               self.sampling), outputs)
                    result = await outputs.prefill_result()
            except TimeoutError:
                client.abort(self.request_id)
                raise RequestFailed(self._late("prefill", self.deadlines.prefill_by), "deadline_exceeded"
                                    ) from None
            except WorkerLost as error:  # its actor or step loop died, or its output stream ended
                self.fleet.mark_failed(prefill.worker_id, f"prefill worker lost: {error}")
                continue
            except WrongRoleError:  # it changed role since it was picked: another one
                continue
            except ChannelClosed:  # the worker is fine and aborted it: submit it again, there or elsewhere
                tried.discard(prefill.worker_id)
                continue
            except SubmissionRefused as refused:  # a grammar that does not compile, too few KV blocks there
                if not any(w.worker_id not in tried for w in self.fleet.active(Role.PREFILL)):
                    raise RequestFailed(f"the request was refused: {refused}", "refused", 400) from None
                continue  # another worker may take it (one started later may have fewer blocks)
            except asyncio.CancelledError:  # the client went away: stop the prefill (and free its KV)
                client.abort(self.request_id)
                raise
            finally:
                client.unsubscribe(outputs)
                self.router.prefill_tokens[prefill.worker_id] -= num_prompt
            if result.finish_reason == "error":
                self.fleet.mark_failed(prefill.worker_id, result.error)
                continue
            return prefill, result
        raise RequestFailed(
            f"the prompt could not be prefilled: {MAX_PREFILL_ATTEMPTS} prefill workers failed",
            "worker_failed",
        )

    async def _decode(self, decode: Worker, request: DecodeRequest, submitted: RequestOutputs | None = None
                      ) -> AsyncGenerator[StreamEvent, None]:
        """`submitted`: the request's outputs, when it was submitted to `decode` already (a choice of a
        request with several, gateway/requests/choices.py); `request` is then what a move sends on."""
        refusers: set[str] = set()  # decode workers that refused it (too few KV blocks, a grammar)
        while True:
            handle: KVHandle | None = None
            if submitted is None and not (decode.is_active and decode.role.can_decode):  # it left meanwhile
                decode = await self._pick_decode(self.deadlines.finish_by)
            left = {decode.worker_id}  # the worker the request moves away from
            try:
                async for event in self._decode_once(decode, request, submitted):
                    yield event
                return
            except _Misrouted:  # the same request (its prefill KV included) goes to another decode worker
                submitted = None
                decode = await self._pick_decode(self.deadlines.finish_by, {decode.worker_id})
                continue
            except _Refused as refused:  # another worker may take it; when none is left, it is a 400
                submitted = None
                refusers.add(decode.worker_id)
                if not any(w.worker_id not in refusers for w in self.fleet.active(Role.DECODE, Role.MIXED)):
                    raise RequestFailed(f"the request was refused: {refused}", "refused", 400) from None
                decode = await self._pick_decode(self.deadlines.finish_by, refusers)
                continue
            except _WorkerLost as lost:
                submitted = None
                self.fleet.mark_failed(decode.worker_id, str(lost))
                # It may have died before pulling the KV it was handed (an evacuated worker's): its holder
                # frees it now rather than at the lease's end (its role change waits for that).
                self._release(request.kv_handle, "the worker it was handed to failed")
                self.num_failed_steps += lost.in_failed_step
                if self.num_failed_steps >= MAX_FAILED_STEPS:
                    raise RequestFailed(f"generation stopped: the step computing this request failed on "
                                        f"{self.num_failed_steps} decode workers", "worker_failed") from None
                if self.num_migrations >= MAX_MIGRATIONS:
                    raise RequestFailed(f"generation stopped: {self.num_migrations + 1} decode workers "
                                        "failed while serving this request", "worker_failed") from None
                self.num_migrations += 1
            except _Evacuated as evacuated:
                submitted = None
                if not self.generated:  # it was still prefilling there: the whole route starts again
                    raise _Requeued from None
                self.num_moves += 1
                handle = evacuated.kv_handle
                if evacuated.may_stay:
                    left = set()
            # Continue elsewhere from what the client has: the new worker pulls the KV of prompt + those
            # tokens from the evacuated worker, or recomputes it (no handle: that worker failed).
            try:
                decode = await self._pick_decode(self.deadlines.finish_by, left)
            except BaseException:
                # Nobody will pull it: its holder (the worker left, or the prefill worker when the handoff
                # had not been pulled yet) may free it now.
                self._release(handle, "the request found no worker to move to")
                raise
            request = DecodeRequest(self.request_id, self.prompt_token_ids, self.sampling,
                                    generated_token_ids=tuple(self.generated), kv_handle=handle,
                                    is_suspect=self.num_failed_steps > 0)

    def _release(self, handle: KVHandle | None, why: str) -> None:
        """Tell the worker holding `handle`'s KV that nobody will pull it (a lease being pulled, or already
        ended, is left alone there: this is always safe)."""
        if handle is None:
            return
        holder = self.fleet.workers.get(handle.source_worker_id)
        if holder is not None:
            holder.client.release_kv(handle.transfer_id, why)

    async def _decode_once(self, decode: Worker, request: DecodeRequest,
                           submitted: RequestOutputs | None = None) -> AsyncGenerator[StreamEvent, None]:
        client = decode.client
        try:
            # Before submitting: no output goes unheard.
            outputs = submitted if submitted is not None else client.subscribe(self.request_id)
        except WorkerLost as error:
            raise _WorkerLost(str(error)) from None
        is_finished = False
        try:
            try:
                if submitted is None:
                    await self._call_worker(client.submit_decode(request, outputs))
            except WrongRoleError:
                is_finished = True  # it never took the request: nothing to abort there
                raise _Misrouted from None
            except SubmissionRefused as refused:
                is_finished = True  # it never took the request
                raise _Refused(str(refused)) from None
            while not is_finished:
                try:
                    output = await self._call_worker(outputs.next())
                except ChannelClosed:  # the worker aborted it and serves on: the request starts again
                    raise _Evacuated(None, may_stay=True) from None
                if output.finish_reason == "error":
                    raise _WorkerLost(output.error or "decode worker failed", output.in_failed_step)
                is_evacuated = output.finish_reason == "migrate"
                is_finished = output.finish_reason is not None  # evacuated: the worker let go of it too
                self.generated.extend(output.token_ids)
                if is_evacuated:
                    if output.token_ids:
                        yield StreamEvent(self.request_id, output.token_ids, output.logprobs,
                                          output.token_times, top_logprobs=output.top_logprobs,
                                          prompt_logprobs=output.prompt_logprobs)
                    raise _Evacuated(output.kv_handle)
                yield StreamEvent(self.request_id, output.token_ids, output.logprobs, output.token_times,
                                  output.finish_reason, output.top_logprobs, output.prompt_logprobs,
                                  decode=output if is_finished else None,
                                  num_migrations=self.num_migrations, num_moves=self.num_moves,
                                  local_prefill_reason=self.local_prefill_reason if is_finished else "",
                                  prefilled_by=decode.worker_id
                                  if is_finished and self.local_prefill_reason else "")
        finally:
            client.unsubscribe(outputs)
            if not is_finished:
                # Client gone, deadline, or worker lost: stop the work there (abort is idempotent).
                client.abort(self.request_id)

    async def _call_worker(self, work: Awaitable[T]) -> T:
        """Await a decode worker's answer within the request's deadline (prefill_by until the first token:
        a worker that prefills the prompt itself keeps the TTFT bound); a lost worker is _WorkerLost."""
        stage, deadline = (("decode", self.deadlines.finish_by) if self.generated else
                           ("prefill", self.deadlines.prefill_by))
        try:
            async with asyncio.timeout(self._left(deadline)):
                return await work
        except TimeoutError:
            raise RequestFailed(self._late(stage, deadline), "deadline_exceeded") from None
        except WorkerLost as error:  # its actor or step loop died, or its output stream ended
            raise _WorkerLost(str(error)) from None

    async def _wait_for_worker(self, role: str, deadline: float, exclude: set[str] | None = None,
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
            if not (self.fleet.is_replacing(*roles) or self._is_role_coming(roles)):
                raise RequestFailed(f"no {role} worker is alive and none is starting", "no_worker")
            if self._left(deadline) <= 0:
                raise RequestFailed(f"no {role} worker became available before the request's deadline",
                                    "no_worker")
            await asyncio.sleep(WORKER_POLL_S)

    def _is_role_coming(self, roles: tuple[Role, ...]) -> bool:
        """Whether a worker is changing role into one of `roles` (it will be routable shortly)."""
        return any(w.next_role in roles for w in self.fleet.workers.values())

    def _is_prefill_coming(self) -> bool:
        return self._is_role_coming((Role.PREFILL,))

    @staticmethod
    def _left(deadline: float) -> float:
        return max(0.0, deadline - time.time())

    def _late(self, stage: str, deadline: float) -> str:
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
