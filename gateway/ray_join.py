"""Joining Ray from a gateway process without giving up its own SIGTERM handling.

`ray.init()` installs a SIGTERM handler that calls `sys.exit()` on the event loop: a frontend (which uvicorn's
supervisor stops with SIGTERM) or a gateway stopped by Kubernetes would then die at once, every request in
flight cut with a bare 500 (seen in the chaos run's supervisor restarts). uvicorn installs its own handler
first (a graceful stop: no new connection, the requests in flight finish within SHUTDOWN_GRACE_S); this puts
it back after Ray's.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import ray

# uvicorn's timeout_graceful_shutdown: the requests in flight may finish this long after a stop signal (a
# supervisor restart, a rolling update); those still open then are cut.
SHUTDOWN_GRACE_S = 30


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
