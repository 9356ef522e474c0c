"""Emptying a worker before it leaves or changes role: the wait, and the limits it runs under.

    wait_until_empty(): polls the worker's load until it holds no request in any state and the gateway has
    nothing on its way to it (the routers' books: in_flight, and on_the_way naming those requests), twice in
    a row; after grace_s its decode streams are evacuated to other workers (again whenever one arrives
    late); past timeout_s, TimeoutError (the caller rolls back).
    Each call to the worker is bounded (CALL_TIMEOUT_S), so that a call left unanswered ends in that
    TimeoutError too instead of holding the change (and every PUT behind it) for good; what it still waits
    for is in worker.emptying meanwhile (/admin/pools shows it).
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from gateway.fleet.workers import Worker

DRAIN_GRACE_S = 30.0  # how long a draining worker's decode streams run on before they are evacuated
DRAIN_TIMEOUT_S = 300.0  # a drain or role change still holding requests by then is rolled back
CALL_TIMEOUT_S = 30.0  # a load or evacuate call unanswered this long: the worker is not emptying


class BooksOnTheWay(Protocol):
    """The routers' count of what they sent a worker and have not seen come back (RoutingBooks)."""

    def in_flight(self, worker_id: str) -> int: ...

    def on_the_way(self, worker_id: str) -> str:
        """Which requests those are, and where each is now (for the wait's explanation)."""
        ...


def check_grace(grace_s: float, timeout_s: float) -> None:
    """A grace at or past the timeout would time every busy drain out before its streams ever moved."""
    if grace_s >= timeout_s:
        raise ValueError(f"drain grace {grace_s:g} s must be below the drain timeout {timeout_s:g} s")


async def wait_until_empty(worker: Worker, books: BooksOnTheWay | None, grace_s: float,
                           timeout_s: float, poll_s: float = 0.05) -> None:
    """Until the worker holds no request in any state and nothing is on its way to it; after `grace_s`
    its decode streams are evacuated (again whenever one arrives late)."""
    event_loop = asyncio.get_running_loop()
    started = event_loop.time()
    num_idle = 0
    try:
        while num_idle < 2:  # twice in a row: a request between the two reads shows in one of them
            waited = event_loop.time() - started
            call_timeout_s = max(min(CALL_TIMEOUT_S, timeout_s - waited), poll_s)
            async with asyncio.timeout(call_timeout_s):
                if waited >= grace_s and worker.role.can_decode:
                    worker.emptying = "evacuating its decode streams"
                    await worker.client.evacuate()
                worker.emptying = "asking for its load"
                load = await worker.client.load()
            on_the_way = books.in_flight(worker.worker_id) if books else 0
            is_idle = load.num_requests == 0 and load.num_free_blocks == load.num_total_blocks
            num_idle = num_idle + 1 if is_idle and not on_the_way else 0
            worker.emptying = (f"{load.num_requests} requests, "
                               f"{load.num_total_blocks - load.num_free_blocks} KV blocks held; "
                               f"{on_the_way} tokens on their way to it")
            if on_the_way and books:
                worker.emptying += f" ({books.on_the_way(worker.worker_id)})"
            if waited > timeout_s:
                raise TimeoutError(f"{worker.worker_id} after {timeout_s:.0f} s: {worker.emptying}")
            await asyncio.sleep(poll_s)
    except TimeoutError as error:
        if not str(error):  # a call's bound: say which
            raise TimeoutError(f"{worker.worker_id}: no answer while {worker.emptying} after "
                               f"{call_timeout_s:.0f} s") from None
        raise
    finally:
        worker.emptying = ""
