"""The chaos run's bookkeeping, without a server: which departures of workers are explained, which
connection errors a frontend fault explains, and the draw that gets every fault kind its minimum."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.departures import WorkerLedger, cause_of
from tests.reliability.chaoslib.driver import FRONTENDS_ONLY, WEIGHTS, FaultDriver, drawable
from tests.reliability.chaoslib.frontends import FrontendCut, FrontendMap
from tests.reliability.chaoslib.log import ChaosLog


def pools(target: dict[str, int], *workers: tuple[str, int | None, str, str]) -> dict[str, Any]:
    return {"target": target, "workers": [{"worker_id": w, "pid": pid, "role": role, "state": state}
                                          for w, pid, role, state in workers]}


def departure_after(events: list[dict[str, Any]], last_state: str = "active",
                    target_after: dict[str, int] | None = None) -> str:
    """The cause found ("" where none is)."""
    ledger = WorkerLedger()
    ledger.observe(10.0, pools({"decode": 1}, ("w-1", 11, "decode", last_state)))
    ledger.observe(20.0, pools(target_after or {"decode": 1}, ("w-2", 12, "decode", "pending")))
    (departure,) = ledger.departures
    return cause_of(departure, events, window_s=30.0) or ""


def test_a_worker_gone_is_explained_only_by_a_fault_that_may_kill_one() -> None:
    assert departure_after([]) == ""
    assert departure_after([{"t_s": 15.0, "kind": "pause_frontend", "start_s": 14.0, "end_s": 15.0},
                            {"t_s": 12.0, "kind": "loop_burst", "start_s": 12.0},
                            {"t_s": 13.0, "kind": "pause_fleet", "start_s": 7.0, "end_s": 13.0}]) == ""
    assert departure_after([{"t_s": 12.0, "kind": "kill", "worker_id": "w-1"}]).startswith("killed")
    assert departure_after([{"t_s": 12.0, "kind": "kill_fleet", "start_s": 12.0, "end_s": 40.0}]
                           ).startswith("fleet")
    # Paused (and resumed), then the fleet killed: the fleet's kill is what took it.
    assert departure_after([{"t_s": 12.0, "kind": "pause_worker", "worker_id": "w-1", "start_s": 4.0},
                            {"t_s": 12.0, "kind": "kill_fleet", "start_s": 12.0, "end_s": 40.0}]
                           ).startswith("fleet")
    assert departure_after([{"t_s": 5.0, "kind": "kill", "worker_id": "w-9"}]).startswith("after kill")
    assert departure_after([{"t_s": -30.0, "kind": "kill", "worker_id": "w-9"}]) == ""  # too long before
    assert departure_after([], last_state="draining").startswith("layout")
    assert departure_after([], target_after={"decode": 0}).startswith("layout")
    # A PUT that was refused changed nothing.
    assert departure_after([{"t_s": 15.0, "kind": "put", "status": 409, "seconds": 0.1}]) == ""


def test_a_pid_that_changes_under_the_same_worker_id_is_a_departure() -> None:
    ledger = WorkerLedger()
    ledger.observe(1.0, pools({"decode": 1}, ("w-1", 11, "decode", "active")))
    ledger.observe(2.0, pools({"decode": 1}, ("w-1", None, "decode", "starting")))  # no pid yet: same one
    assert not ledger.departures
    ledger.observe(3.0, pools({"decode": 1}, ("w-1", 12, "decode", "active")))
    assert [(d["worker_id"], d["pid"]) for d in ledger.departures] == [("w-1", 11)]


def test_only_connections_a_frontend_fault_held_are_cut_by_it() -> None:
    config = ChaosConfig(num_frontends=2)
    frontends = FrontendMap(config, ChaosTarget("http://127.0.0.1:8000", Path("."), 1, lambda pid: True),
                            ChaosLog(), random.Random(0))
    frontends.cuts.append(FrontendCut("kill_frontend", 42, 50.0, frozenset({40001, 40002})))
    assert frontends.cut_of(40001, 45.0, 51.0) is not None
    assert frontends.cut_of(40003, 45.0, 51.0) is None  # on the other frontend
    assert frontends.cut_of(40001, 52.0, 60.0) is None  # opened after the fault (the port reused)
    assert frontends.cut_of(None, 45.0, 51.0) is None


def test_frontend_faults_are_drawn_only_with_several_frontends_and_each_gets_its_minimum() -> None:
    assert not set(drawable(ChaosConfig())) & set(FRONTENDS_ONLY)
    config = ChaosConfig(num_frontends=2, min_each_fault=2, skip_faults=("kill_fleet",))
    assert set(drawable(config)) == set(WEIGHTS) - {"kill_fleet"}
    log = ChaosLog()
    driver = FaultDriver(config, None, None, log, None, random.Random(0), None, None, None, None, None, None)  # type: ignore[arg-type]
    driver.injected.update({kind: 2 for kind in drawable(config) if kind != "pause_fleet"})
    num_drawn = sum(driver.injected.values())
    log.start -= 570.0  # 570 s in: about num_drawn / 19 draws left, fewer than twice the 2 still short
    assert (30.0 * num_drawn / 570.0) / 2 <= 2
    assert {driver._draw(drawable(config), until_s=600.0) for _ in range(20)} == {"pause_fleet"}
    log.start += 470.0  # 100 s in: there is time, the weights decide
    assert len({driver._draw(drawable(config), until_s=600.0) for _ in range(50)}) > 1
