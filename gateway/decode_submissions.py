"""Decode submissions, batched: the requests handed to one decode worker in one turn of the gateway's event
loop travel in one actor call.

    submit(worker, request, channel_id) → queued in the worker's open batch (the first one opens it and
      schedules its flush for the end of this loop turn) → awaits its answer
    flush: one submit_many(requests, channel_id) call → per request "" (started) or why it was refused
      → each submitter resumes, or raises ValueError (refused) or the call's error (the worker is lost:
        RayActorError, or RayTaskError from WorkerFailed) for every request of the batch
A prefill step finishes many prompts at once, so their handoffs arrive together: one call per batch costs
the gateway and the busy decode process one message instead of one per request. A submitter cancelled
meanwhile (its client left) still has its request sent: the batch leaves before the cancellation arrives,
and the abort the orchestrator then sends reaches the worker after it (Ray keeps one caller's calls to an
actor in order).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from decode_pool.messages import DecodeRequest
from gateway.workers import Worker


@dataclass
class _Batch:
    actor: object
    channel_id: str
    entries: list[tuple[DecodeRequest, asyncio.Future[None]]] = field(default_factory=list)


class DecodeSubmissions:
    def __init__(self) -> None:
        self._open: dict[tuple[str, str], _Batch] = {}  # (worker id, channel id) → the batch still filling
        self._answering: set[asyncio.Task[None]] = set()  # the sent batches' answer tasks (kept referenced)

    async def submit(self, worker: Worker, request: DecodeRequest, channel_id: str) -> None:
        """Start `request` on `worker`, its outputs going to `channel_id`; returns once the worker took it."""
        key = (worker.worker_id, channel_id)
        batch = self._open.get(key)
        if batch is None or batch.actor is not worker.actor:
            batch = self._open[key] = _Batch(worker.actor, channel_id)
            asyncio.get_running_loop().call_soon(self._send, key, batch)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        batch.entries.append((request, future))
        await future

    def _send(self, key: tuple[str, str], batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        requests = [request for request, _ in batch.entries]
        ref = batch.actor.submit_many.remote(requests, batch.channel_id)  # type: ignore[attr-defined]
        task = asyncio.get_running_loop().create_task(self._answer(ref, batch.entries))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    @staticmethod
    async def _answer(ref: object, entries: list[tuple[DecodeRequest, asyncio.Future[None]]]) -> None:
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
