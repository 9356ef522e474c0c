"""A worker that outlives its fleet actor ends itself once that actor is gone for good.

The workers of a fleet run by a FleetActor (gateway/control/fleet_actor.py) are detached Ray actors, so that
when the fleet actor dies and Ray restarts it, they live on with their weights, KV cache and running streams,
and the restarted fleet adopts them (gateway/fleet/adoption.py) instead of loading the model again. Detached,
nothing would end them should the fleet actor die for good (`ray.kill`, its owner gone): this watch does.

    KeeperWatch(name).start() → a daemon thread asks Ray every CHECK_S whether an actor of that name exists
    (a restarting actor keeps its name; only a dead one loses it) → once it has been missing for GONE_S in
    a row → on_gone() (the actor's process exits). Any other answer (Ray slow, the GCS restarting) is not
    "missing": a worker is never ended on a doubt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import get_current_placement_group, remove_placement_group

logger = logging.getLogger(__name__)

CHECK_S = 5.0
GONE_S = 30.0  # long enough for a fleet that Ray kills and its supervisor creates again under the same name


def exit_process() -> None:
    """The worker's process ends, and with it its ranks' placement group (detached, as the worker: nothing
    else would give their resources back, review P4)."""
    logger.warning("the fleet actor that kept this worker is gone for good: exiting")
    with contextlib.suppress(Exception):  # none (a worker of one rank), or Ray is going too
        group = get_current_placement_group()
        if group is not None:
            remove_placement_group(group)
    os._exit(0)


class KeeperWatch:
    def __init__(self, keeper_name: str, on_gone: Callable[[], None] = exit_process,
                 check_s: float = CHECK_S, gone_s: float = GONE_S) -> None:
        self.keeper_name = keeper_name
        self._on_gone = on_gone
        self._check_s, self._gone_s = check_s, gone_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keeper-watch", daemon=True)

    def start(self) -> KeeperWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def is_present(self) -> bool | None:
        """Whether Ray knows an actor of the keeper's name; None: Ray did not say."""
        try:
            ray.get_actor(self.keeper_name)
        except ValueError:  # no live or restarting actor has that name
            return False
        except Exception:
            return None
        return True

    def _run(self) -> None:
        missing_since: float | None = None
        while not self._stopping.wait(self._check_s):
            present = self.is_present()
            if present is None:
                continue
            if present:
                missing_since = None
                continue
            missing_since = missing_since or time.monotonic()
            if time.monotonic() - missing_since >= self._gone_s:
                self._on_gone()
                return
