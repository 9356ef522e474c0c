"""How a gateway process stops on a signal: gracefully, with a clear answer for every request in flight.

    SIGTERM / SIGINT (uvicorn's supervisor stopping a frontend, Kubernetes stopping a pod, Ctrl-C)
      → still starting (waiting for the fleet): the start is cancelled, the process ends (unless_stopped)
      → uvicorn: no new connection; the requests in flight may finish within shutdown_grace_s
      → at 0.8 × shutdown_grace_s, each request still open ends with a clear error (503, code
        "shutting_down": a stream gets its error event and [DONE]), so that none is left for uvicorn to cut
        at the grace's end with a bare 500
      → the lifespan ends: the fleet (its own, not a named one) stops

`ray.init()` installs a SIGTERM handler that calls `sys.exit()` on the event loop: the process would then die
at once, every request in flight a bare 500 (seen in the chaos run's supervisor restarts). join_ray() puts
uvicorn's handler back after Ray's; on_stop_signal() chains a callback before it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import ray

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
END_REQUESTS_AT = 0.8  # of the grace: requests still open then end with a clear error, before uvicorn cuts


def join_ray(**init_args: Any) -> None:
    """ray.init(**init_args), keeping this process's SIGTERM handler (uvicorn's graceful stop)."""
    if threading.current_thread() is not threading.main_thread():  # Ray installs nothing then
        ray.init(**init_args)
        return
    handler = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(**init_args)
    finally:
        signal.signal(signal.SIGTERM, handler)


def on_stop_signal(callback: Callable[[], None]) -> None:
    """Call `callback` on the running loop when a stop signal arrives, then the handler that was there
    (uvicorn's). Only from the main thread's loop (elsewhere nothing is installed: signals reach only the
    main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)

        def chained(signum: int, frame: Any, previous: Any = previous) -> None:
            loop.call_soon_threadsafe(callback)
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:  # nobody else handles it: what the signal does by default
                signal.signal(signum, signal.SIG_DFL)
                signal.raise_signal(signum)

        signal.signal(sig, chained)


async def unless_stopped(work: Awaitable[T]) -> T:
    """Await `work` (a start-up step: the fleet to start or to come back), cancelled by a stop signal: uvicorn
    reacts to a signal only once its start-up is done, so a process waiting here for a fleet that does not
    come would otherwise never stop, and its supervisor would wait for it for ever (seen in a chaos run)."""
    task = asyncio.ensure_future(work)

    def stop() -> None:
        if not task.done():
            task.cancel()

    on_stop_signal(stop)
    return await task


def end_requests_before_the_grace(grace_s: float, end_requests: Callable[[], None]) -> None:
    """On a stop signal, end the requests still open at END_REQUESTS_AT of the grace (once)."""
    loop = asyncio.get_running_loop()
    scheduled: list[asyncio.TimerHandle] = []

    def stopping() -> None:
        if not scheduled:
            scheduled.append(loop.call_later(END_REQUESTS_AT * grace_s, end_requests))

    on_stop_signal(stopping)
