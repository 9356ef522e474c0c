"""A local Ray for the tests, started without Ray's log monitor.

The log monitor tails every worker's log files to forward their lines to the driver, globbing the log folder
and reading each open file every 0.1 s: 4-6% of a core for each Ray instance for as long as it lives (about
90 CPU-s of a whole suite on two workers, 2026-12-06). The tests call `ray.init(log_to_driver=False)`, so
nothing it forwards is ever shown. `ray start` has a switch for it (`--include-log-monitor=false`, which
tests/helpers/local_cluster.py passes); `ray.init` has none, so the head's parameters get it here.
"""

from __future__ import annotations

from typing import Any


def init_local_ray(**init_args: Any) -> None:
    """ray.init(**init_args) for a new local instance with no log monitor."""
    import ray
    from ray._private import parameter

    plain = parameter.RayParams

    class WithoutLogMonitor(plain):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("include_log_monitor", False)
            super().__init__(*args, **kwargs)

    parameter.RayParams = WithoutLogMonitor  # ray.init looks the class up on the module at call time
    try:
        ray.init(**init_args)
    finally:
        parameter.RayParams = plain
