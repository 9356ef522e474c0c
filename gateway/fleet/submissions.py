"""Submissions to workers, batched: the requests the gateway hands one worker in one turn of its event loop
travel in one actor call.

    submit(worker, method, request, channel_id) → queued in the worker's open batch for that method (the
      first one opens it and schedules its flush for the end of this loop turn) → awaits its answer
    flush: one <method>(requests, channel_id) call (WorkerActor.submit_prefills or submit_decodes) → per
      request "" (started) or why it was refused
      → each submitter resumes, or raises ValueError (refused) or the call's error (the worker is lost:
        RayActorError, or RayTaskError from WorkerFailed) for every request of the batch
The results come back on the worker's output stream (gateway/fleet/output_streams.py), not in the answer.
Requests arrive together (a burst of clients; a prefill step finishing many prompts, whose handoffs follow
at once): one call per batch costs the gateway and the busy worker process one message instead of one per
request. A submitter cancelled meanwhile (its client left) still has its request sent: the batch leaves
before the cancellation arrives, and the abort the orchestrator then sends reaches the worker after it (Ray
keeps one caller's calls to an actor in order).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from decode_pool.messages import DecodeRequest
from gateway.fleet.workers import Worker
from prefill_pool.messages import PrefillRequest

SubmittedRequest = PrefillRequest | DecodeRequest
SubmitMethod = Literal["submit_prefills", "submit_decodes"]  # WorkerActor's batch methods


@dataclass
class _Batch:
    actor: object
    method: SubmitMethod
    channel_id: str
    entries: list[tuple[SubmittedRequest, asyncio.Future[None]]] = field(default_factory=list)


class Submissions:
    def __init__(self) -> None:
        # (worker id, method, channel id) → the batch still filling
        self._open: dict[tuple[str, SubmitMethod, str], _Batch] = {}
        self._answering: set[asyncio.Task[None]] = set()  # the sent batches' answer tasks (kept referenced)

    async def submit(self, worker: Worker, method: SubmitMethod, request: SubmittedRequest, channel_id: str
                     ) -> None:
        """Hand `request` to `worker` through its actor method `method`, outputs going to `channel_id`;
        returns once the worker took it."""
        key = (worker.worker_id, method, channel_id)
        batch = self._open.get(key)
        if batch is None or batch.actor is not worker.actor:
            batch = self._open[key] = _Batch(worker.actor, method, channel_id)
            asyncio.get_running_loop().call_soon(self._send, key, batch)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch.entries.append((request, future))
        await future

    def _send(self, key: tuple[str, SubmitMethod, str], batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        requests = [request for request, _ in batch.entries]
        ref = getattr(batch.actor, batch.method).remote(requests, batch.channel_id)
        task = asyncio.get_running_loop().create_task(self._answer(ref, batch.entries))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    @staticmethod
    async def _answer(ref: object, entries: list[tuple[SubmittedRequest, asyncio.Future[None]]]) -> None:
        try:
            refusals: list[str] = await ref  # type: ignore[misc]
        except Exception as error:  # the worker is lost, or the call failed: every request hears it
            for _, future in entries:
                if not future.done():
                    future.set_exception(error)
            return
        for (_, future), refusal in zip(entries, refusals, strict=True):
            if future.done():
                continue
            if refusal:
                future.set_exception(ValueError(refusal))
            else:
                future.set_result(None)
