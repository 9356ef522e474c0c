"""LoopTask: the one asyncio task a controller (ratio, scale) runs its loop in while it is on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class LoopTask:
    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    @property
    def is_on(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self, loop: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run `loop()` unless it runs already; whether it was started now."""
        if self.is_on:
            return False
        self._task = asyncio.create_task(loop())
        return True

    async def stop(self) -> bool:
        """Cancel the loop and wait for it to end (a change it was applying rolls back first); whether it
        was running."""
        task, self._task = self._task, None
        if task is None:
            return False
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return True
