"""A pytest plugin (benchmarks/suite_cpu.py loads it): each xdist worker logs when it starts each test."""

from __future__ import annotations

import os
import time
from typing import IO

_log: IO[str] | None = None


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    global _log
    worker, out = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PDSERVE_SUITE_CPU_LOGS")
    if not worker or not out:
        return
    if _log is None:
        _log = open(os.path.join(out, f"{worker}.log"), "a", buffering=1)  # noqa: SIM115  (open for the run)
        _log.write(f"{time.time():.3f} PID {os.getpid()}\n")  # its environment in /proc does not name it
    _log.write(f"{time.time():.3f} {nodeid}\n")
