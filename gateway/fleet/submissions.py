"""Submissions to one worker, batched: the requests the gateway hands the worker in one turn of its event
loop travel in one actor call.

    submit(request, channel_id) → queued in the open batch for that channel (the first one opens it and
      schedules its flush for the end of this loop turn) → awaits its answer
    flush: one send(requests, channel_id) call (the worker client's submit_prefills or submit_decodes)
      → per request "" (started) or why it was refused
      → each submitter resumes, or raises SubmissionRefused, or the call's error (WorkerLost, WrongRoleError)
        for every request of the batch
The results come back on the worker's output stream (gateway/fleet/output_streams.py), not in the answer.
Requests arrive together (a burst of clients; a prefill step finishing many prompts, whose handoffs follow
at once): one call per batch costs the gateway and the busy worker process one message instead of one per
request. A submitter cancelled meanwhile (its client left) still has its request sent, and the abort the
orchestrator then sends may overtake it (Ray does not keep call order for async actors): the worker
remembers aborts of requests it has not seen and refuses them when they come (worker_runtime/aborted.py).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.fleet.worker_errors import SubmissionRefused

RequestT = TypeVar("RequestT")


@dataclass
class _Batch(Generic[RequestT]):
    channel_id: str
    entries: list[tuple[RequestT, asyncio.Future[None]]] = field(default_factory=list)


class Submissions(Generic[RequestT]):
    def __init__(self, send: Callable[[list[RequestT], str], Awaitable[list[str]]]) -> None:
        """Args:
        send: makes the worker's batch call at once; its answer is, per request, why it was refused ("" if
            it started).
        """
        self._send_batch = send
        self._open: dict[str, _Batch[RequestT]] = {}  # channel id → the batch still filling
        self._answering: set[asyncio.Task[None]] = set()  # the sent batches' answer tasks (kept referenced)

    async def submit(self, request: RequestT, channel_id: str) -> None:
        """Hand `request` to the worker, outputs going to `channel_id`; returns once the worker took it."""
        batch = self._open.get(channel_id)
        if batch is None:
            batch = self._open[channel_id] = _Batch(channel_id)
            asyncio.get_running_loop().call_soon(self._send, batch)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch.entries.append((request, future))
        await future

    def _send(self, batch: _Batch[RequestT]) -> None:
        if self._open.get(batch.channel_id) is batch:
            del self._open[batch.channel_id]
        try:
            answer = self._send_batch([request for request, _ in batch.entries], batch.channel_id)  # sent now
        except Exception as error:  # refused before it left (a request Ray cannot serialise): each hears it
            for _, future in batch.entries:
                if not future.done():
                    future.set_exception(error)
            return
        # Several requests' batch: none of their contexts (log lines' request ids).
        task = asyncio.get_running_loop().create_task(self._answer(answer, batch),
                                                      context=contextvars.Context())
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    @staticmethod
    async def _answer(answer: Awaitable[list[str]], batch: _Batch[RequestT]) -> None:
        try:
            refusals = await answer
        except Exception as error:  # the worker is lost, or the call failed: every request hears it
            for _, future in batch.entries:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), refusal in zip(batch.entries, refusals, strict=True):
            if future.done():
                continue
            if refusal:
                future.set_exception(SubmissionRefused(refusal))
            else:
                future.set_result(None)
