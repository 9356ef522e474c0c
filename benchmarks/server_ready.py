"""Wait for a `pdserve serve` to run at its steady speed: every worker's model body compiled (or eager for
good), not still compiling beside serving (llm_engine/compilation.py).

A worker serves from its load under `--compile auto`, eager while its body compiles on a thread beside
serving; a benchmark that measures steady-state speed starts its load after that, or its first minute would
measure the compile. (A benchmark of how the fleet grows, benchmarks/scale_auto.py, waits only for the
workers it starts with: the ones it adds compile beside serving, as a user's would.)
"""

from __future__ import annotations

import time

import httpx


def compiling_workers(url: str) -> list[str]:
    """The workers whose body still compiles beside serving, by GET /admin/pools."""
    pools = httpx.get(f"{url}/admin/pools", timeout=5).json()
    return [w["worker_id"] for w in pools.get("workers", [])
            if (w.get("runtime") or {}).get("compile") == "compiling"]


def wait_compiled(url: str, timeout_s: float = 600.0) -> float:
    """Return once no worker compiles any more (seconds waited); SystemExit after `timeout_s`."""
    start = time.monotonic()
    while compiling := compiling_workers(url):
        if time.monotonic() - start > timeout_s:
            raise SystemExit(f"{', '.join(compiling)} still compiling after {timeout_s:.0f} s")
        time.sleep(1.0)
    return time.monotonic() - start
