"""A worker's output channels: one long-lived stream per subscriber (a gateway), one message per step.

    gateway:          stream(channel_id) (a Ray streaming call, held open);
                      subscribe(request_id, channel_id) before each request is submitted (no output unheard)
    step loop thread: collect(output) for every output of the step → flush() once at the step's end:
                      the step's outputs cross to the actor's event loop in one call_soon_threadsafe
    event loop:       _publish(batch) sorts them by channel → each open stream yields everything queued for
                      it as one OutputBatch (a reader that fell behind catches up in one item)
    stream closed:    (the gateway left or cancelled it) every request it was carrying is aborted
    close_channels(): a gateway taken for gone (a frontend that stopped reporting: it died, or is paused)
                      → its channels end as if it had closed them, each open stream's last item marked
                      `closed_by_fleet`: a gateway that was only paused reads that it lost its streams
                      (and its requests here), not that this worker died
The step loop never waits on a reader: flush() only schedules a callback, and a channel's queue grows until
its stream takes it. The channels belong to the worker actor, not to a role, so a gateway's stream stays open
across role changes: a prefill worker sends each prompt's result on it, a decode or mixed worker each
step's tokens. The outputs are the roles' own messages; all the channels need is each one's request_id and
whether it is a request's last (`is_final`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol


class Output(Protocol):
    @property
    def request_id(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class OutputBatch:
    """What one output stream carries per item: the outputs of one or more steps, in order, for the
    requests of one subscriber (several outputs of one request when its reader fell behind)."""

    outputs: tuple[Any, ...]  # the roles' messages (PrefillResult, DecodeOutput)
    closed_by_fleet: bool = False  # the stream's last item: close_channels() ended it, the worker serves on


@dataclasses.dataclass
class _Channel:
    pending: list[Output] = dataclasses.field(default_factory=list)  # not yet taken by its stream
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    request_ids: set[str] = dataclasses.field(default_factory=set)  # requests it carries, unfinished
    is_closed: bool = False  # its gateway is gone: the stream ends at its next wake


class OutputChannels:
    def __init__(self, abort: Callable[[str], None], is_final: Callable[[Any], bool]) -> None:
        """Args:
        abort: ends a request on the worker (when the stream carrying it closes).
        is_final: whether an output is its request's last (the request then leaves its channel).
        """
        self._channels: dict[str, _Channel] = {}
        self._channel_of: dict[str, str] = {}  # request id → channel id, until the request finishes
        self._step_outputs: list[Output] = []  # this step's outputs (step loop thread only)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.abort = abort
        self.is_final = is_final

    # The actor's event loop.
    def subscribe(self, request_id: str, channel_id: str) -> None:
        """Route the request's outputs to `channel_id` (call before submitting it to the worker)."""
        self._event_loop = asyncio.get_running_loop()
        self._channel(channel_id).request_ids.add(request_id)
        self._channel_of[request_id] = channel_id

    def unsubscribe(self, request_id: str) -> None:
        """The request never reached the worker (its submission was refused)."""
        channel = self._channels.get(self._channel_of.pop(request_id, ""))
        if channel is not None:
            channel.request_ids.discard(request_id)

    async def stream(self, channel_id: str) -> AsyncIterator[OutputBatch]:
        """Everything routed to the channel, in order, as batches; runs until the caller closes it."""
        self._event_loop = asyncio.get_running_loop()
        channel = self._channel(channel_id)
        try:
            while True:
                await channel.ready.wait()
                channel.ready.clear()
                if channel.is_closed:
                    yield OutputBatch((), closed_by_fleet=True)
                    return
                outputs, channel.pending = channel.pending, []
                yield OutputBatch(tuple(outputs))
        finally:
            # The gateway is gone (or gave this stream up): nobody will read these requests' tokens.
            self._end(channel_id, channel)

    def close_channels(self, prefix: str) -> int:
        """End every channel whose id starts with `prefix` (one gateway's), aborting what they carry; a
        stream still open on one returns. Returns how many channels there were."""
        closing = [(channel_id, channel) for channel_id, channel in self._channels.items()
                   if channel_id.startswith(prefix)]
        for channel_id, channel in closing:
            channel.is_closed = True
            channel.ready.set()  # an open stream wakes, returns, and ends the channel in its finally
            self._end(channel_id, channel)  # and if none is open, it ends here
        return len(closing)

    def _end(self, channel_id: str, channel: _Channel) -> None:
        if self._channels.get(channel_id) is channel:
            del self._channels[channel_id]
        requests, channel.request_ids = channel.request_ids, set()
        for request_id in requests:
            self._channel_of.pop(request_id, None)
            self.abort(request_id)

    # The step loop's thread.
    def collect(self, output: Output) -> None:
        self._step_outputs.append(output)

    def flush(self) -> None:
        """Hand the step's outputs to the event loop in one call (never waits for a reader)."""
        if not self._step_outputs:
            return
        batch, self._step_outputs = self._step_outputs, []
        assert self._event_loop is not None, "a request was subscribed before it produced output"
        self._event_loop.call_soon_threadsafe(self._publish, batch)

    def _publish(self, batch: list[Output]) -> None:
        for output in batch:
            channel_id = self._channel_of.get(output.request_id)
            channel = self._channels.get(channel_id) if channel_id is not None else None
            if channel is None:
                continue  # its stream closed: the request was aborted, this is its last word
            if self.is_final(output):
                del self._channel_of[output.request_id]
                channel.request_ids.discard(output.request_id)
            channel.pending.append(output)
            channel.ready.set()

    def _channel(self, channel_id: str) -> _Channel:
        channel = self._channels.get(channel_id)
        if channel is None:
            channel = self._channels[channel_id] = _Channel()
        return channel
