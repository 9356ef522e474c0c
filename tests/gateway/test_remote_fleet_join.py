"""A frontend that starts while the fleet actor is restarting waits for its fleet to be started again.

Found by the chaos run of the deployed configuration (benchmarks/chaos.py --frontends 2): a frontend
killed just before the fleet actor was, restarted by uvicorn while the supervisor was starting the fleet
again, failed its startup ("the fleet has not started" from info()); uvicorn's supervisor took that exit
status for a broken app and stopped the whole server. No Ray here: the fleet client wraps a fake handle that
answers as the restarting actor does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from ray.exceptions import ActorUnavailableError

from gateway.control import remote_fleet
from gateway.control.fleet_client import FleetClient
from gateway.control.messages import FleetInfo, FleetSnapshot
from gateway.control.remote_fleet import RemoteFleet
from gateway.fleet.workers import PoolHealth
from gateway.requests.router import LocalPrefillPolicy

INFO = FleetInfo("/model", 4096, 16, "nixl")


class _Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class RestartingFleet:
    """Restarting for `num_down` probes, then up but not started for `num_unstarted`, then started."""

    def __init__(self, num_down: int, num_unstarted: int) -> None:
        self.num_down, self.num_unstarted = num_down, num_unstarted
        self.num_probes = 0
        self.started_config = _Method(self._started_config)
        self.info = _Method(self._info)
        self.view = _Method(self._view)
        self.report = _Method(self._report)
        self.heartbeat = _Method(lambda frontend_id: None)  # ray.get() of it fails: the thread shrugs
        self.note_prompt = _Method(lambda num_tokens: None)
        self._num_views = 0

    def _is_started(self) -> bool:
        return self.num_probes > self.num_down + self.num_unstarted

    async def _started_config(self) -> object | None:
        self.num_probes += 1
        if self.num_probes <= self.num_down:
            raise ActorUnavailableError("The actor is restarting", None)
        return "config" if self._is_started() else None

    async def _info(self) -> FleetInfo:
        if not self._is_started():
            raise RuntimeError("the fleet has not started")
        return INFO

    async def _report(self, report: object) -> int:
        return INFO.kv_tokens_per_decode_worker  # the admission share

    async def _view(self, version: int, epoch: str) -> FleetSnapshot:
        self._num_views += 1
        if self._num_views > 1:  # the follow loop's long poll: nothing changes
            await asyncio.sleep(3600)
        health = PoolHealth("ok", {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, 0, 0)
        return FleetSnapshot("epoch", 1, (), (), health, LocalPrefillPolicy(), 1 << 20)


def test_a_frontend_started_while_the_fleet_restarts_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote_fleet, "JOIN_RETRY_S", 0.01)
    handle = RestartingFleet(num_down=3, num_unstarted=4)
    fleet = RemoteFleet(FleetClient(handle), "frontend-test")

    async def join() -> FleetInfo:
        try:
            info, share = await fleet.join()
            assert share == INFO.kv_tokens_per_decode_worker
            return info
        finally:
            await fleet.stop()

    assert asyncio.run(join()) == INFO
    assert handle.num_probes == 8  # 3 restarting, 4 not started, then started
    assert fleet.health().status == "ok"


def test_a_worker_this_frontend_reported_failed_counts_as_being_replaced(monkeypatch: pytest.MonkeyPatch
                                                                         ) -> None:
    """Found by the same chaos run: with frontends, the only decode worker killed mid-stream failed its
    streams at once ("none is starting"): the fleet confirms a reported failure with its own probe before
    it starts the replacement, and the frontend's last snapshot did not show one yet. The frontend now
    counts its own report as a replacement coming (for REPORTED_FAILED_S), so its requests wait for it."""
    from gateway.control.messages import WorkerEntry
    from worker_runtime.roles import Role

    reported: list[str] = []
    handle = RestartingFleet(num_down=0, num_unstarted=0)
    handle.mark_failed = _Method(lambda worker_id, why: reported.append(worker_id))
    fleet = RemoteFleet(FleetClient(handle), "frontend-test")
    health = PoolHealth("ok", {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, 0, 0)
    fleet._apply(FleetSnapshot("epoch", 1, (WorkerEntry("w-decode", "decode", "active", None, None),), (),
                               health, LocalPrefillPolicy(), 1 << 20))
    assert not fleet.is_replacing(Role.DECODE, Role.MIXED)
    fleet.mark_failed("w-decode", "decode worker lost: its output stream failed")
    assert reported == ["w-decode"] and not fleet.active(Role.DECODE)
    assert fleet.is_replacing(Role.DECODE, Role.MIXED) and not fleet.is_replacing(Role.PREFILL)
    monkeypatch.setattr(remote_fleet, "REPORTED_FAILED_S", 0.0)
    assert not fleet.is_replacing(Role.DECODE)  # the fleet had its time to say so itself


def test_a_frontend_stops_even_when_a_cancel_lands_as_a_report_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by full test runs (a test server that never stopped, twice): the report loop waited with
    asyncio.wait_for, which in Python 3.11 loses a cancellation that lands as its inner wait finishes, and
    went on for ever, holding the frontend's shutdown. Each round wakes the loop (a long prompt noted) as it
    stops it: before the fix about one round in twenty hung."""
    monkeypatch.setattr(remote_fleet, "REPORT_S", 0.001)
    monkeypatch.setattr(remote_fleet, "HEARTBEAT_S", 3600.0)  # the heartbeat thread waits, then stops

    async def rounds() -> int:
        num_stopped = 0
        for i in range(200):
            fleet = RemoteFleet(FleetClient(RestartingFleet(num_down=0, num_unstarted=0)), f"frontend-{i}")
            await fleet.join()
            fleet.start(None, None)  # type: ignore[arg-type]  # the loops alone: no request path here
            await asyncio.sleep(0.001 * (i % 4))
            fleet.note_prompt(1 << 20)  # a long prompt: the report loop wakes now
            await asyncio.wait_for(fleet.stop(), 5.0)
            num_stopped += 1
        return num_stopped

    assert asyncio.run(rounds()) == 200
