"""A client that leaves before its response starts: the work it asked for is cancelled (ClientGone), so a
request nobody waits for any more frees its place in the line and its workers at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed its connection before its response started."""


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (then ClientGone)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        # The body is already read: the next ASGI message is the disconnect, whenever it comes.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()  # or the work's own exception
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()


async def all_or_none(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, in order; on the first failure the rest are cancelled (a batch of prompts whose one
    fails stops generating the others for nobody) and that failure raises as itself."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_awaited(w)) for w in work]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def _awaited(work: Awaitable[T]) -> T:
    return await work
