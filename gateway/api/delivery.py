"""Delivery of an SSE stream, written straight to the ASGI send, with a bound: a client that stops reading
cannot hold the response forever.

    __call__: headers → one `send` per chunk of the body iterator → the empty last body, all by `send_by`
    (wall clock: the request's finish_by + a grace); one that is not (the client's receive window stayed
    shut) ends: on_stalled() is told and the connection is closed.
    A client that disconnects is noticed by one watcher task, which cancels the response's own task while
    it streams; the cancellation is taken back and the response ends as if it had finished.
    Whatever ends the response (done, stalled, client gone), the body iterator is closed explicitly, so that
    the request's cleanup (aborting both workers) does not wait for the garbage collector.

Why not Starlette's StreamingResponse: under ASGI spec < 2.4 (uvicorn's 2.3) it runs each response in an
anyio task group (a cancel scope, a task for the body, one for the disconnect listener) and adds a frame of
its own per chunk; here the body is written from the request's own task, and only the listener is a task.
The bytes on the wire are the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from starlette.background import BackgroundTask
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)


class BoundedStreamingResponse(Response):
    def __init__(self, content: AsyncIterator[str], send_by: float, on_stalled: Callable[[], None],
                 media_type: str, background: BackgroundTask | None = None) -> None:
        self.body_iterator = content
        self.status_code = 200
        self.media_type = media_type
        self.background = background
        self.init_headers(None)
        self.send_by = send_by  # time.time() by which the whole response must have been sent
        self.on_stalled = on_stalled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        is_streaming = True  # cleared, before any await, once the body loop is left
        is_gone = False

        async def watch_for_disconnect() -> None:
            nonlocal is_gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if is_streaming:
                is_gone = True
                task.cancel()  # delivered at the body loop's current (or next) await

        watcher = asyncio.ensure_future(watch_for_disconnect())
        # One timer for the whole response, not one per chunk: generation itself ends by finish_by (the
        # orchestrator's deadline), so what runs past send_by is a send the client does not take.
        send_by = asyncio.get_running_loop().time() + (self.send_by - time.time())
        try:
            async with asyncio.timeout_at(send_by):
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            # Returning without finishing the response makes the server close the connection.
            logger.warning("a client stopped reading its stream; the connection is closed")
            self.on_stalled()
            return
        except asyncio.CancelledError:
            if not is_gone:
                raise
            task.uncancel()  # our own cancellation: the client left, and the response is over
        finally:
            is_streaming = False
            watcher.cancel()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if self.background is not None:
            await self.background()
