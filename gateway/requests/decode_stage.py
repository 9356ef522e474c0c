"""The decode stage of one request: a decode (or mixed) worker pulls the prompt's KV and generates, and the
stream survives that worker failing or leaving.

    decode_stream(): on one worker at a time (decode_once()): subscribe to its outputs under a new attempt id
      → submit (DecodeRequest: the prefill's first token and KVHandle, or the tokens the client has and the KV
      another worker offers) → outputs → events, until the worker's answer ends it there. That end is a
      Leave, read once off the worker's FinishReason and its client's errors:
        FINISHED   stop, length, abort: the request is done
        MISROUTED  the worker changed role since it was picked: the same request goes to another
        REFUSED    too few KV blocks there, a grammar it cannot compile: another worker, or a 400
        LOST       its actor or step loop died, or it answered finish "error": marked failed; the request
                   migrates with the tokens the client has (up to MAX_MIGRATIONS); if the failing step
                   computed it, as a suspect (next_suspect_group(): it may be what breaks the steps), and it
                   ends with an error once it fails alone
        MIGRATE    it handed the request back (finish "migrate": it changes role or leaves, or clears itself
                   for a long prompt): moved without marking it failed, pulling the KV it offers
        CLOSED     the fleet closed the stream (it took this frontend for gone): started again, there or
                   elsewhere, recomputing prompt + the tokens the client has
      A request handed back (MIGRATE, CLOSED) before its first token is requeued (RequestState.is_requeued):
      the orchestrator routes it again from the start.
    Every way out of a worker but FINISHED, MIGRATE and a refusal aborts the request there (idempotent); the
    holder of KV nobody will pull is told to free it (release()).
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from decode_pool.messages import DecodeOutput, DecodeRequest
from gateway.fleet.output_streams import RequestOutputs
from gateway.fleet.worker_errors import ChannelClosed, SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests.events import FailureCode, RequestFailed, StreamEvent
from gateway.requests.route import RequestRoute
from gateway.requests.state import RequestState
from kv_transfer import KVHandle
from llm_engine.finish_reason import FinishReason
from worker_runtime.roles import Role

T = TypeVar("T")
MAX_MIGRATIONS = 3  # decode workers a request may move across before it ends with an error
# Steps a request may see fail while it was in their batch. A request that broke one worker's forward may be
# what breaks every forward it is in (a "query of death"): the suspects of one failure are tried again as a
# group, halved at each failure of theirs, and a suspect whose step fails with it alone is the culprit
# (an error). 64 requests take 7 halvings to name one: 8 covers a full batch.
MAX_FAILED_STEPS = 8


class LeaveReason(enum.Enum):
    """Why a request left the decode worker it was on (see the module docstring)."""

    FINISHED = enum.auto()
    MISROUTED = enum.auto()
    REFUSED = enum.auto()
    LOST = enum.auto()
    MIGRATE = enum.auto()
    CLOSED = enum.auto()


@dataclass(frozen=True)
class Leave:
    """How one decode attempt ended (decode_once()'s last item)."""

    reason: LeaveReason
    message: str = ""  # why (LOST, REFUSED)
    kv_handle: KVHandle | None = None  # MIGRATE: the stream's KV, offered by the worker it left
    in_failed_step: bool = False  # LOST: the step that failed computed this request
    failed_step_id: str = ""  # ... and names that step
    num_in_failed_step: int = 0  # ... and how many requests it computed (1: this one alone)

    @classmethod
    def lost(cls, message: str, output: DecodeOutput | None = None) -> Leave:
        if output is None:
            return cls(LeaveReason.LOST, message)
        return cls(LeaveReason.LOST, message, in_failed_step=output.in_failed_step,
                   failed_step_id=output.failed_step_id, num_in_failed_step=output.num_in_failed_step)


def next_suspect_group(group: str, failed_step_id: str, request_id: str) -> str:
    """The request's suspect group after a step it was in failed: that step's whole batch the first time
    (one forward tells whether the failure follows them); a suspect's group in halves (by a stable hash of the
    request's id, so each member picks its half alone)."""
    if not group:
        return failed_step_id
    half = hashlib.blake2b(f"{failed_step_id}|{request_id}".encode(), digest_size=1).digest()[0] & 1
    return f"{failed_step_id}/{half}"


async def decode_stream(state: RequestState, route: RequestRoute, decode: Worker, request: DecodeRequest,
                        submitted: RequestOutputs | None = None) -> AsyncGenerator[StreamEvent, None]:
    """The request's stream from `decode` on, moved to other decode workers as they fail or hand it back.
    `submitted`: the request's outputs, when it was submitted to `decode` already (a choice of a
    request with several, gateway/requests/choices.py); `request` is then what a move sends on."""
    finish_by = state.deadlines.finish_by
    refusers: set[str] = set()  # decode workers that refused it (too few KV blocks, a grammar)
    while True:
        if submitted is None and not (decode.is_active and decode.role.can_decode):  # it left meanwhile
            decode = await route.pick_decode(finish_by)
        leave = Leave(LeaveReason.FINISHED)
        async for item in decode_once(state, route, decode, request, submitted):
            if isinstance(item, Leave):
                leave = item
            else:
                yield item
        submitted = None
        handle: KVHandle | None = None  # the KV the next worker pulls; None: it recomputes
        left = {decode.worker_id}  # the worker the request moves away from
        match leave.reason:
            case LeaveReason.FINISHED:
                return
            case LeaveReason.MISROUTED:  # the same request (its prefill KV included) goes to another
                request = dataclasses.replace(request, request_id=state.new_attempt_id())
                decode = await route.pick_decode(finish_by, left)
                continue
            case LeaveReason.REFUSED:  # another worker may take it; when none is left, it is a 400
                request = dataclasses.replace(request, request_id=state.new_attempt_id())
                refusers.add(decode.worker_id)
                if not any(w.worker_id not in refusers for w in route.fleet.active(Role.DECODE, Role.MIXED)):
                    raise RequestFailed(f"the request was refused: {leave.message}", FailureCode.REFUSED, 400)
                decode = await route.pick_decode(finish_by, refusers)
                continue
            case LeaveReason.LOST:
                route.fleet.mark_failed(decode.worker_id, leave.message)
                # It may have died before pulling the KV it was handed (an evacuated worker's): its holder
                # frees it now rather than at the lease's end (its role change waits for that).
                release(route, request.kv_handle, "the worker it was handed to failed")
                blame(state, leave)
                if state.num_migrations >= MAX_MIGRATIONS:
                    raise RequestFailed(f"generation stopped: {state.num_migrations + 1} decode workers "
                                        "failed while serving this request", FailureCode.WORKER_FAILED)
                state.num_migrations += 1
            case LeaveReason.MIGRATE | LeaveReason.CLOSED:
                if not state.generated:  # it was still prefilling there: the whole route starts again
                    state.is_requeued = True
                    return
                state.num_moves += 1
                handle = leave.kv_handle
                if leave.reason is LeaveReason.CLOSED:  # the worker serves on: it may take it again
                    left = set()
        # Continue elsewhere from what the client has: the new worker pulls the KV of prompt + those
        # tokens from the worker that offered it, or recomputes it.
        try:
            decode = await route.pick_decode(finish_by, left)
        except BaseException:
            # Nobody will pull it: its holder (the worker left, or the prefill worker when the handoff
            # had not been pulled yet) may free it now.
            release(route, handle, "the request found no worker to move to")
            raise
        request = DecodeRequest(state.new_attempt_id(), state.prompt_token_ids, state.sampling,
                                generated_token_ids=tuple(state.generated), kv_handle=handle,
                                suspect_group=state.suspect_group)


def blame(state: RequestState, leave: Leave) -> None:
    """A decode worker failed while holding the request: if its failing step computed the request, the
    request becomes (or stays) a suspect, and ends with an error once it has failed alone as one."""
    if not leave.in_failed_step:
        return
    state.num_failed_steps += 1
    is_named = bool(state.suspect_group) and leave.num_in_failed_step == 1  # it failed alone again
    if is_named or state.num_failed_steps >= MAX_FAILED_STEPS:
        raise RequestFailed(f"generation stopped: the step computing this request failed on "
                            f"{state.num_failed_steps} decode workers", FailureCode.WORKER_FAILED)
    state.suspect_group = next_suspect_group(state.suspect_group, leave.failed_step_id, state.request_id)


def release(route: RequestRoute, handle: KVHandle | None, why: str) -> None:
    """Tell the worker holding `handle`'s KV that nobody will pull it (a lease being pulled, or already
    ended, is left alone there: this is always safe)."""
    if handle is None:
        return
    holder = route.fleet.workers.get(handle.source_worker_id)
    if holder is not None:
        holder.client.release_kv(handle.transfer_id, why)


async def decode_once(state: RequestState, route: RequestRoute, decode: Worker, request: DecodeRequest,
                      submitted: RequestOutputs | None = None) -> AsyncGenerator[StreamEvent | Leave, None]:
    """The request on one decode worker: its events, then how it left (a Leave, always the last item)."""
    client = decode.client
    route.at(f"{'submitting to' if submitted is None else 'decoding on'} {decode.worker_id}")
    attempt_id = submitted.request_id if submitted is not None else request.request_id  # the worker's id
    try:
        # Before submitting: no output goes unheard.
        outputs = submitted if submitted is not None else client.subscribe(attempt_id)
    except WorkerLost as error:
        yield Leave.lost(str(error))
        return
    is_held = True  # the worker may hold the request: abort it there unless it let go
    try:
        if submitted is None:
            try:
                await call_worker(state, client.submit_decode(request, outputs))
            except WrongRoleError:
                is_held = False  # it never took the request
                yield Leave(LeaveReason.MISROUTED)
                return
            except SubmissionRefused as refused:
                is_held = False
                yield Leave(LeaveReason.REFUSED, str(refused))
                return
        route.at(f"decoding on {decode.worker_id}")
        while True:
            output = await call_worker(state, outputs.next())
            if output.finish_reason == FinishReason.ERROR:
                # Tokens coalesced into the error's output never reach the client: the next worker computes
                # them again after the ones the client has.
                yield Leave.lost(output.error or "decode worker failed", output)
                return
            state.generated.extend(output.token_ids)
            if output.token_ids:  # computed in its suspect group's own forward: the worker lifted suspicion
                state.suspect_group = ""
            is_finished = output.finish_reason is not None
            is_held = not is_finished  # a final output (evacuated too): the worker let go of it
            if output.finish_reason == FinishReason.MIGRATE:
                if output.token_ids:
                    yield StreamEvent(state.request_id, output.token_ids, output.logprobs,
                                      output.token_times, top_logprobs=output.top_logprobs,
                                      prompt_logprobs=output.prompt_logprobs)
                yield Leave(LeaveReason.MIGRATE, kv_handle=output.kv_handle)
                return
            yield StreamEvent(state.request_id, output.token_ids, output.logprobs, output.token_times,
                              output.finish_reason, output.top_logprobs, output.prompt_logprobs,
                              decode=output if is_finished else None,
                              num_migrations=state.num_migrations, num_moves=state.num_moves,
                              local_prefill_reason=state.local_prefill_reason if is_finished else "",
                              prefilled_by=decode.worker_id
                              if is_finished and state.local_prefill_reason else "")
            if is_finished:
                yield Leave(LeaveReason.FINISHED)
                return
    except ChannelClosed:  # the worker aborted it and serves on: the request starts again
        yield Leave(LeaveReason.CLOSED)
    except WorkerLost as error:  # its actor or step loop died, or its output stream ended
        yield Leave.lost(str(error))
    finally:
        client.unsubscribe(outputs)
        if is_held:
            # Client gone, deadline, or worker lost: stop the work there (abort is idempotent).
            client.abort(attempt_id)


async def call_worker(state: RequestState, work: Awaitable[T]) -> T:
    """Await a decode worker's answer within the request's deadline (prefill_by until the first token: a
    worker that prefills the prompt itself keeps the TTFT bound)."""
    stage, deadline = state.stage_deadline
    try:
        async with asyncio.timeout(state.time_left(deadline)):
            return await work
    except TimeoutError:
        raise RequestFailed(state.late(stage, deadline), FailureCode.DEADLINE_EXCEEDED) from None
