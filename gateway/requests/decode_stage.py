"""The decode stage of one request: a decode (or mixed) worker pulls the prompt's KV and generates, and the
stream survives that worker failing or leaving.

    decode_stream(): subscribe to the worker's outputs → submit (DecodeRequest: the prefill's first token and
      KVHandle, or the tokens the client has and the KV another worker offers) → outputs → events, until a
      finish reason. decode_once() runs it on one worker; what ends it there early is an exception:
        Misrouted       the worker changed role since it was picked: the same request goes to another
        Refused         too few KV blocks there, a grammar it cannot compile: another worker, or a 400
        WorkerLostHere  its actor or step loop died, or it answered finish "error": marked failed; the
                        request migrates with the tokens the client has (up to MAX_MIGRATIONS); if the
                        failing step computed it, as a suspect (next_suspect_group(): it may be what breaks
                        the steps), and it ends with an error once it fails alone
        Evacuated       it hands the request back (finish "migrate": it changes role or leaves), or the fleet
                        closed the stream: moved without marking it failed, pulling the KV it offers
        Requeued        handed back before its first token: the orchestrator routes it again from the start
    Every way out of a worker aborts the request there (idempotent), and tells the holder of KV nobody will
    pull to free it (release()).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TYPE_CHECKING, TypeVar

from decode_pool.messages import DecodeRequest
from gateway.fleet.output_streams import RequestOutputs
from gateway.fleet.worker_errors import ChannelClosed, SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests.events import RequestFailed, StreamEvent
from kv_transfer import KVHandle
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from gateway.requests.orchestrator import RequestRun

T = TypeVar("T")
MAX_MIGRATIONS = 3  # decode workers a request may move across before it ends with an error
# Steps a request may see fail while it was in their batch. A request that broke one worker's forward may be
# what breaks every forward it is in (a "query of death"): the suspects of one failure are tried again as a
# group, halved at each failure of theirs, and a suspect whose step fails with it alone is the culprit
# (an error). 64 requests take 7 halvings to name one: 8 covers a full batch.
MAX_FAILED_STEPS = 8


def next_suspect_group(group: str, failed_step_id: str, request_id: str) -> str:
    """The request's suspect group after a step it was in failed: that step's whole batch the first time
    (one forward tells whether the failure follows them); a suspect's group in halves (by a stable hash of the
    request's id, so each member picks its half alone)."""
    if not group:
        return failed_step_id
    half = hashlib.blake2b(f"{failed_step_id}|{request_id}".encode(), digest_size=1).digest()[0] & 1
    return f"{failed_step_id}/{half}"


class WorkerLostHere(Exception):
    """A worker failed while holding this request (internal: triggers a retry or a migration)."""

    def __init__(self, message: str, in_failed_step: bool = False, failed_step_id: str = "",
                 num_in_failed_step: int = 0) -> None:
        super().__init__(message)
        self.in_failed_step = in_failed_step  # the request was in the batch whose step raised
        self.failed_step_id = failed_step_id  # that step's name (the suspects' next group)
        self.num_in_failed_step = num_in_failed_step  # how many requests it computed (1: this one alone)


class Evacuated(Exception):
    """The decode worker is changing role or leaving and handed the request back, or the fleet closed the
    stream carrying it (internal: it migrates, and the worker is not marked failed)."""

    def __init__(self, kv_handle: KVHandle | None, may_stay: bool = False) -> None:
        super().__init__("evacuated")
        self.kv_handle = kv_handle  # the stream's KV, offered by the worker it left; None: recompute it
        self.may_stay = may_stay  # the worker serves on (a closed stream): it may take the request again


class Misrouted(Exception):
    """The decode worker no longer decodes (it changed role after it was picked): pick another (internal)."""


class Refused(Exception):
    """The decode worker refused the request (internal: another one may take it; none: a 400)."""


class Requeued(Exception):
    """A request handed back before its first token (internal: it is routed again from the start, so a
    long prompt goes to the prefill pool rather than to whichever decode worker takes the stream)."""


async def decode_stream(run: RequestRun, decode: Worker, request: DecodeRequest,
                 submitted: RequestOutputs | None = None) -> AsyncGenerator[StreamEvent, None]:
    """The request's stream from `decode` on, moved to other decode workers as they fail or hand it back.
    `submitted`: the request's outputs, when it was submitted to `decode` already (a choice of a
    request with several, gateway/requests/choices.py); `request` is then what a move sends on."""
    refusers: set[str] = set()  # decode workers that refused it (too few KV blocks, a grammar)
    while True:
        handle: KVHandle | None = None
        if submitted is None and not (decode.is_active and decode.role.can_decode):  # it left meanwhile
            decode = await run.pick_decode(run.deadlines.finish_by)
        left = {decode.worker_id}  # the worker the request moves away from
        try:
            async for event in decode_once(run, decode, request, submitted):
                yield event
            return
        except Misrouted:  # the same request (its prefill KV included) goes to another decode worker
            submitted = None
            request = dataclasses.replace(request, request_id=run.new_attempt_id())
            decode = await run.pick_decode(run.deadlines.finish_by, {decode.worker_id})
            continue
        except Refused as refused:  # another worker may take it; when none is left, it is a 400
            submitted = None
            request = dataclasses.replace(request, request_id=run.new_attempt_id())
            refusers.add(decode.worker_id)
            if not any(w.worker_id not in refusers for w in run.fleet.active(Role.DECODE, Role.MIXED)):
                raise RequestFailed(f"the request was refused: {refused}", "refused", 400) from None
            decode = await run.pick_decode(run.deadlines.finish_by, refusers)
            continue
        except WorkerLostHere as lost:
            submitted = None
            run.fleet.mark_failed(decode.worker_id, str(lost))
            # It may have died before pulling the KV it was handed (an evacuated worker's): its holder
            # frees it now rather than at the lease's end (its role change waits for that).
            release(run, request.kv_handle, "the worker it was handed to failed")
            if lost.in_failed_step:
                run.num_failed_steps += 1
                is_named = bool(run.suspect_group) and lost.num_in_failed_step == 1  # it failed alone again
                if is_named or run.num_failed_steps >= MAX_FAILED_STEPS:
                    raise RequestFailed(f"generation stopped: the step computing this request failed on "
                                        f"{run.num_failed_steps} decode workers", "worker_failed") from None
                run.suspect_group = next_suspect_group(run.suspect_group, lost.failed_step_id,
                                                       run.request_id)
            if run.num_migrations >= MAX_MIGRATIONS:
                raise RequestFailed(f"generation stopped: {run.num_migrations + 1} decode workers "
                                    "failed while serving this request", "worker_failed") from None
            run.num_migrations += 1
        except Evacuated as evacuated:
            submitted = None
            if not run.generated:  # it was still prefilling there: the whole route starts again
                raise Requeued from None
            run.num_moves += 1
            handle = evacuated.kv_handle
            if evacuated.may_stay:
                left = set()
        # Continue elsewhere from what the client has: the new worker pulls the KV of prompt + those
        # tokens from the evacuated worker, or recomputes it (no handle: that worker failed).
        try:
            decode = await run.pick_decode(run.deadlines.finish_by, left)
        except BaseException:
            # Nobody will pull it: its holder (the worker left, or the prefill worker when the handoff
            # had not been pulled yet) may free it now.
            release(run, handle, "the request found no worker to move to")
            raise
        request = DecodeRequest(run.new_attempt_id(), run.prompt_token_ids, run.sampling,
                                generated_token_ids=tuple(run.generated), kv_handle=handle,
                                suspect_group=run.suspect_group)


def release(run: RequestRun, handle: KVHandle | None, why: str) -> None:
    """Tell the worker holding `handle`'s KV that nobody will pull it (a lease being pulled, or already
    ended, is left alone there: this is always safe)."""
    if handle is None:
        return
    holder = run.fleet.workers.get(handle.source_worker_id)
    if holder is not None:
        holder.client.release_kv(handle.transfer_id, why)


async def decode_once(run: RequestRun, decode: Worker, request: DecodeRequest,
                      submitted: RequestOutputs | None = None) -> AsyncGenerator[StreamEvent, None]:
    """The request on one decode worker, until it finishes or leaves it (the exceptions above say why)."""
    client = decode.client
    run.at(f"{'submitting to' if submitted is None else 'decoding on'} {decode.worker_id}")
    attempt_id = submitted.request_id if submitted is not None else request.request_id  # the worker's id
    try:
        # Before submitting: no output goes unheard.
        outputs = submitted if submitted is not None else client.subscribe(attempt_id)
    except WorkerLost as error:
        raise WorkerLostHere(str(error)) from None
    is_finished = False
    try:
        try:
            if submitted is None:
                await call_worker(run, client.submit_decode(request, outputs))
        except WrongRoleError:
            is_finished = True  # it never took the request: nothing to abort there
            raise Misrouted from None
        except SubmissionRefused as refused:
            is_finished = True  # it never took the request
            raise Refused(str(refused)) from None
        run.at(f"decoding on {decode.worker_id}")
        while not is_finished:
            try:
                output = await call_worker(run, outputs.next())
            except ChannelClosed:  # the worker aborted it and serves on: the request starts again
                raise Evacuated(None, may_stay=True) from None
            if output.finish_reason == "error":
                raise WorkerLostHere(output.error or "decode worker failed", output.in_failed_step,
                                     output.failed_step_id, output.num_in_failed_step)
            if output.token_ids:  # computed in its suspect group's own forward: the worker lifted suspicion
                run.suspect_group = ""
            is_evacuated = output.finish_reason == "migrate"
            is_finished = output.finish_reason is not None  # evacuated: the worker let go of it too
            run.generated.extend(output.token_ids)
            if is_evacuated:
                if output.token_ids:
                    yield StreamEvent(run.request_id, output.token_ids, output.logprobs,
                                      output.token_times, top_logprobs=output.top_logprobs,
                                      prompt_logprobs=output.prompt_logprobs)
                raise Evacuated(output.kv_handle)
            yield StreamEvent(run.request_id, output.token_ids, output.logprobs, output.token_times,
                              output.finish_reason, output.top_logprobs, output.prompt_logprobs,
                              decode=output if is_finished else None,
                              num_migrations=run.num_migrations, num_moves=run.num_moves,
                              local_prefill_reason=run.local_prefill_reason if is_finished else "",
                              prefilled_by=decode.worker_id
                              if is_finished and run.local_prefill_reason else "")
    finally:
        client.unsubscribe(outputs)
        if not is_finished:
            # Client gone, deadline, or worker lost: stop the work there (abort is idempotent).
            client.abort(attempt_id)


async def call_worker(run: RequestRun, work: Awaitable[T]) -> T:
    """Await a decode worker's answer within the request's deadline (prefill_by until the first token:
    a worker that prefills the prompt itself keeps the TTFT bound); a lost worker is WorkerLostHere."""
    stage, deadline = (("decode", run.deadlines.finish_by) if run.generated else
                       ("prefill", run.deadlines.prefill_by))
    try:
        async with asyncio.timeout(run.time_left(deadline)):
            return await work
    except TimeoutError:
        raise RequestFailed(run.late(stage, deadline), "deadline_exceeded") from None
    except WorkerLost as error:  # its actor or step loop died, or its output stream ended
        raise WorkerLostHere(str(error)) from None
