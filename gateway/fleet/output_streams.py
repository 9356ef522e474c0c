"""The gateway's end of one worker's output channel: one Ray stream per worker, fanned out to requests.

    subscribe(request_id) → a RequestOutputs (its queue), before the request is submitted
      → the reader task (started with the first subscriber, kept while the worker lives, across its role
        changes: the worker's channels outlive its roles) reads the worker's output_stream(channel_id): one
        item per step with every request's outputs (a prefill worker's PrefillResults, a decode worker's
        new tokens), and puts each output into its request's queue
      → unsubscribe() when the request is done with that worker (prefilled, finished, moved, client left)
      → close() when the worker leaves the deployment: the reader stops and the remote stream is cancelled
        (ray.cancel), so that no generator stays parked on the worker.
A reader whose stream fails (the worker's actor died) hands WorkerLost to every request it carries; one the
fleet closed (it took this frontend for gone: closed_by_fleet) hands ChannelClosed instead, which marks no
worker failed. Either way the next subscriber starts a fresh reader under a new channel id. Nothing here
aborts a request: the orchestrator does that, and closing a stream aborts what it carries on the worker's
side.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import ray

from decode_pool.messages import DecodeOutput, coalesce
from gateway.fleet.worker_errors import ChannelClosed, WorkerLost
from prefill_pool.messages import PrefillResult
from worker_runtime.output_channels import OutputBatch

logger = logging.getLogger(__name__)


@dataclass
class RequestOutputs:
    """One request's outputs from one worker, in order; WorkerLost if the worker's stream failed,
    ChannelClosed if the fleet closed it."""

    request_id: str
    channel_id: str  # the stream they arrive on
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
    # Names this reader's stream to the worker, and no other: a new stream under the name of one that has
    # not closed yet would share its outputs with it.
    channel_id: str
    requests: dict[str, RequestOutputs] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    stream: ray.ObjectRefGenerator | None = None  # the remote generator, once the call is made


class OutputStream:
    def __init__(self, worker_id: str, gateway_id: str,
                 open_stream: Callable[[str], ray.ObjectRefGenerator]) -> None:
        """Args:
        gateway_id: names this gateway to the worker (part of every channel id).
        open_stream: the worker's output_stream(channel_id) call.
        """
        self.worker_id = worker_id
        self._gateway_id = gateway_id
        self._open_stream = open_stream
        self._num_readers = itertools.count()
        self._reader: _Reader | None = None
        self._is_closed = False

    def subscribe(self, request_id: str) -> RequestOutputs:
        """Where the request's outputs will arrive (call before submitting it there)."""
        if self._is_closed:
            raise WorkerLost(f"{self.worker_id} left the deployment")
        reader = self._reader
        if reader is None:
            reader = self._reader = _Reader(f"{self._gateway_id}-{self.worker_id}-{next(self._num_readers)}")
            # It outlives the request that opened it: an empty context, so its log lines carry no request id.
            reader.task = asyncio.get_running_loop().create_task(self._read(reader),
                                                                 name=f"outputs-{self.worker_id}",
                                                                 context=contextvars.Context())
        outputs = reader.requests[request_id] = RequestOutputs(request_id, reader.channel_id)
        return outputs

    def unsubscribe(self, outputs: RequestOutputs) -> None:
        if self._reader is not None and self._reader.channel_id == outputs.channel_id:
            self._reader.requests.pop(outputs.request_id, None)

    def request_ids(self) -> list[str]:
        """The requests whose outputs this gateway awaits from the worker."""
        return list(self._reader.requests) if self._reader is not None else []

    def close(self) -> None:
        """The worker left the deployment: stop reading it, and end the stream on the worker's side."""
        self._is_closed = True
        reader, self._reader = self._reader, None
        if reader is None:
            return
        if reader.task is not None:
            reader.task.cancel()
        if reader.stream is not None:
            # Dropping the generator would leave the worker's side parked, holding a concurrency slot.
            with contextlib.suppress(Exception):
                ray.cancel(reader.stream)
        for outputs in reader.requests.values():  # normally none: a worker leaves once drained
            outputs.queue.put_nowait(WorkerLost(f"{self.worker_id} left the deployment"))

    async def _read(self, reader: _Reader) -> None:
        reader.stream = self._open_stream(reader.channel_id)
        error: BaseException = WorkerLost(f"the output stream of {self.worker_id} ended")
        try:
            async for ref in reader.stream:
                batch: OutputBatch = await ref
                for output in batch.outputs:
                    outputs = reader.requests.get(output.request_id)
                    if outputs is not None:
                        outputs.queue.put_nowait(output)
                if batch.closed_by_fleet:
                    error = ChannelClosed(f"the fleet ended this frontend's stream from {self.worker_id}")
        except asyncio.CancelledError:
            raise
        except Exception as failure:  # the actor died (RayActorError), or its call failed
            error = WorkerLost(f"the output stream of {self.worker_id} failed: {type(failure).__name__}")
        logger.info("the output stream of %s ended: %s", self.worker_id, error)
        if self._reader is reader:
            self._reader = None  # the next subscriber starts a fresh stream
        for outputs in reader.requests.values():
            outputs.queue.put_nowait(error)
