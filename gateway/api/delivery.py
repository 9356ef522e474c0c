"""Delivery of an SSE stream with a bound: a client that stops reading cannot hold the response forever.

    stream_response: the response must be sent by `send_by` (wall clock: the request's finish_by + a grace);
    one that is not (the client's receive window stayed shut) ends: on_stalled() is told and the connection
    is closed.
    Whatever ends the response (done, stalled, client gone), the body iterator is closed explicitly, so that
    the request's cleanup (aborting both workers) does not wait for the garbage collector.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.background import BackgroundTask
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class DeliveryStalled(Exception):
    """The client did not read the response before its deadline."""


class BoundedStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[str], send_by: float, on_stalled: Callable[[], None],
                 media_type: str, background: BackgroundTask | None = None) -> None:
        super().__init__(content, media_type=media_type, background=background)
        self.send_by = send_by  # time.time() by which the whole response must have been sent
        self.on_stalled = on_stalled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except DeliveryStalled:
            # Returning without finishing the response makes the server close the connection.
            logger.warning("a client stopped reading its stream; the connection is closed")
            self.on_stalled()

    async def stream_response(self, send: Send) -> None:
        # One timer for the whole response, not one per chunk: generation itself ends by finish_by (the
        # orchestrator's deadline), so what runs past send_by is a send the client does not take.
        send_by = asyncio.get_running_loop().time() + (self.send_by - time.time())
        try:
            async with asyncio.timeout_at(send_by):
                await super().stream_response(send)
        except TimeoutError:
            raise DeliveryStalled() from None
        finally:
            # Shielded: on a disconnect this runs inside a cancelled scope.
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
