"""The gateway's end of the workers' output channels: one Ray stream per worker, fanned out to requests.

    subscribe(worker, request_id) → a RequestOutputs (its queue), before the request is submitted
      → the worker's reader task (started with its first subscriber, kept while the worker lives) reads the
        worker's output_stream(channel_id): one item per step with every request's outputs (a prefill
        worker's PrefillResults, a decode worker's new tokens), and puts each output into its request's queue
      → unsubscribe() when the request is done with that worker (prefilled, finished, moved, client left).
A reader whose stream fails (the worker's actor died) hands the error to every request it carries, which
the orchestrator treats as a lost worker; the next subscriber starts a fresh reader. Nothing here aborts a
request: the orchestrator does that, and closing a stream aborts what it carries on the worker's side.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass, field

from decode_pool.messages import DecodeOutput, coalesce
from gateway.fleet.workers import Worker
from pool_worker.runtime.output_channels import OutputBatch
from prefill_pool.messages import PrefillResult

logger = logging.getLogger(__name__)


@dataclass
class RequestOutputs:
    """One request's outputs from one worker, in order; an exception if the worker's stream failed."""

    request_id: str
    reader: _Reader  # the stream it arrives on
    queue: asyncio.Queue[DecodeOutput | PrefillResult | BaseException] = field(default_factory=asyncio.Queue)

    async def next(self) -> DecodeOutput:
        """The next decode output, with everything queued behind it merged in (a reader behind catches up)."""
        first = await self.queue.get()
        if isinstance(first, BaseException):
            raise first
        assert isinstance(first, DecodeOutput), f"a decode request got {type(first).__name__}"
        outputs = [first]
        while not self.queue.empty() and outputs[-1].finish_reason is None:
            item = self.queue.get_nowait()
            if not isinstance(item, DecodeOutput):
                self.queue.put_nowait(item)  # after the outputs that came before it
                break
            outputs.append(item)
        return coalesce(outputs)

    async def prefill_result(self) -> PrefillResult:
        """The prompt's result from a prefill worker."""
        result = await self.queue.get()
        if isinstance(result, BaseException):
            raise result
        assert isinstance(result, PrefillResult), f"a prefill request got {type(result).__name__}"
        return result


@dataclass
class _Reader:
    actor: object  # the worker's actor handle it reads (a replacement actor gets another reader)
    # Names this reader's stream to the worker, and no other: a reader given up (forget()) may leave its
    # stream open on the worker, and a new stream under the same name would share its outputs with it.
    channel_id: str
    requests: dict[str, RequestOutputs] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None


class OutputStreams:
    def __init__(self) -> None:
        self._gateway_id = f"gateway-{uuid.uuid4().hex[:12]}"  # names this gateway to every worker
        self._num_readers = itertools.count()
        self._readers: dict[str, _Reader] = {}  # by worker id

    def subscribe(self, worker: Worker, request_id: str) -> RequestOutputs:
        """Where the request's outputs from `worker` will arrive (call before submitting it there)."""
        reader = self._readers.get(worker.worker_id)
        if reader is None or reader.actor is not worker.actor:
            channel_id = f"{self._gateway_id}-{next(self._num_readers)}"
            reader = self._readers[worker.worker_id] = _Reader(worker.actor, channel_id)
            reader.task = asyncio.get_running_loop().create_task(self._read(worker.worker_id, reader),
                                                                 name=f"outputs-{worker.worker_id}")
        outputs = reader.requests[request_id] = RequestOutputs(request_id, reader)
        return outputs

    def request_ids(self, worker_id: str) -> list[str]:
        """The requests whose outputs this gateway awaits from the worker."""
        reader = self._readers.get(worker_id)
        return list(reader.requests) if reader is not None else []

    @staticmethod
    def unsubscribe(outputs: RequestOutputs) -> None:
        outputs.reader.requests.pop(outputs.request_id, None)

    def forget(self, worker_id: str) -> None:
        """The worker left the deployment: stop reading it."""
        reader = self._readers.pop(worker_id, None)
        if reader is not None and reader.task is not None:
            reader.task.cancel()
            for outputs in reader.requests.values():  # normally none: a worker leaves once drained
                outputs.queue.put_nowait(ConnectionError(f"{worker_id} left the deployment"))

    def close(self) -> None:
        for worker_id in list(self._readers):
            self.forget(worker_id)

    async def _read(self, worker_id: str, reader: _Reader) -> None:
        stream = reader.actor.output_stream.remote(reader.channel_id)  # type: ignore[attr-defined]
        error: BaseException
        try:
            async for ref in stream:
                batch: OutputBatch = await ref
                for output in batch.outputs:
                    outputs = reader.requests.get(output.request_id)
                    if outputs is not None:
                        outputs.queue.put_nowait(output)
            error = ConnectionError(f"the output stream of {worker_id} ended")
        except asyncio.CancelledError:
            raise
        except Exception as failure:  # the actor died (RayActorError), or its call failed
            error = failure
        logger.info("the output stream of %s ended: %s", worker_id, type(error).__name__)
        if self._readers.get(worker_id) is reader:
            del self._readers[worker_id]  # the next subscriber starts a fresh stream
        for outputs in reader.requests.values():
            outputs.queue.put_nowait(error)
