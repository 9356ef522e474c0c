"""No healthy worker replaced: every worker (id, pid) as /admin/pools shows it over the run, each departure
(its id gone, or its pid changed) and what caused it.

A departure is allowed, with its cause, when:
  layout   it was last seen draining or changing role, or its role's target fell (a layout change removed it)
  killed   the driver killed, paused or broke that very worker (kill_busy, pause_worker, hang_step,
           step_error, query_of_death)
  fleet    the fleet actor was killed after the worker was first seen (a worker that was not active yet is
           killed by the restart; an active one must be adopted: fleet_faults.py checks that)
  after    a fault that may kill workers (kill_busy, pause_worker, kill_fleet, a layout change applied: a PUT
           answered 200, auto on/off) was under way within replacement_window_s before the worker was last
           seen: attributed to that fault
Anything else (a worker gone after only frontend faults, pause_fleet or loop_burst) is a violation of
"no_healthy_worker_replaced", reported with the driver's actions before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.reliability.chaoslib.config import ChaosConfig
from tests.reliability.chaoslib.log import ChaosLog

KILLS_WORKERS = ("kill", "pause_worker", "kill_fleet", "put", "auto_off_mid_move", "hang_step", "step_error",
                 "query_of_death")
TOUCHES_ITS_WORKERS = ("kill", "pause_worker", "hang_step", "step_error", "query_of_death")


@dataclass
class WorkerLedger:
    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker id → what was last seen of it
    departures: list[dict[str, Any]] = field(default_factory=list)
    _target: dict[str, int] = field(default_factory=dict)  # the layout aimed at, as last seen

    def observe(self, now_s: float, pools: dict[str, Any]) -> None:
        target = {role: int(n) for role, n in (pools.get("target") or {}).items()}
        seen = {w["worker_id"]: w for w in pools.get("workers", [])}
        for worker_id, worker in seen.items():
            known = self.live.get(worker_id)
            pid = worker.get("pid")
            if known is not None and pid and known["pid"] and pid != known["pid"]:  # restarted in place
                self._depart(known, now_s, target)
                known = None
            if known is None:
                known = self.live[worker_id] = {"worker_id": worker_id, "pid": pid, "first_seen_s": now_s}
            known.update(role=worker.get("role"), state=worker.get("state"), last_seen_s=now_s,
                         pid=pid or known["pid"])
        for worker_id in set(self.live) - set(seen):
            self._depart(self.live.pop(worker_id), now_s, target)
        self._target = target

    def _depart(self, known: dict[str, Any], now_s: float, target: dict[str, int]) -> None:
        self.departures.append({**known, "gone_s": round(now_s, 3), "target_before": dict(self._target),
                                "target_after": target})


def _span(event: dict[str, Any]) -> tuple[float, float]:
    """When the fault was under way: a PUT from its sending to its answer, a pause or kill as it logged."""
    if event["kind"] == "put":
        return event["t_s"] - float(event.get("seconds") or 0.0), event["t_s"]
    return float(event.get("start_s", event["t_s"])), float(event.get("end_s", event["t_s"]))


def cause_of(departure: dict[str, Any], events: list[dict[str, Any]], window_s: float) -> str | None:
    """What explains the departure (None: nothing does)."""
    worker_id, role, gone_s = departure["worker_id"], departure["role"], departure["gone_s"]
    faults = [e for e in events if e["kind"] in KILLS_WORKERS
              and (e["kind"] != "put" or e.get("status") == 200) and _span(e)[0] <= gone_s]
    for event in sorted(faults, key=lambda e: -_span(e)[0]):  # the latest fault that explains it
        if event["kind"] in TOUCHES_ITS_WORKERS and worker_id in (event.get("worker_id"),
                                                                   *event.get("worker_ids", ())):
            return f"killed ({event['kind']} at t={_span(event)[0]:.1f} s)"
        if event["kind"] == "kill_fleet" and _span(event)[0] >= departure["first_seen_s"]:
            return f"fleet (killed at t={_span(event)[0]:.1f} s)"
    if departure.get("state") in ("draining", "changing_role"):
        return f"layout (last seen {departure['state']})"
    if departure["target_after"].get(role, 0) < departure["target_before"].get(role, 0):
        return f"layout (the {role} target fell)"
    near = [e for e in faults if _span(e)[1] + window_s >= departure["last_seen_s"]]
    if near:
        last = max(near, key=lambda e: _span(e)[0])
        return f"after {last.get('fault') or last['kind']} at t={_span(last)[0]:.1f} s"
    return None


def check_departures(ledger: WorkerLedger, log: ChaosLog, config: ChaosConfig) -> list[dict[str, Any]]:
    """Each departure with its cause; the unexplained ones are violations."""
    rows = []
    for departure in ledger.departures:
        cause = cause_of(departure, log.events, config.replacement_window_s)
        rows.append({**departure, "cause": cause})
        if cause is None:
            since = departure["last_seen_s"] - 60.0
            log.violate("no_healthy_worker_replaced",
                        f"{departure['worker_id']} ({departure['role']}, pid {departure['pid']}, last seen "
                        f"{departure['state']} at t={departure['last_seen_s']:.1f} s) was gone at "
                        f"t={departure['gone_s']:.1f} s with no fault that may kill a worker before it",
                        worker_id=departure["worker_id"], pid=departure["pid"],
                        recent_actions=[e for e in log.events if since <= e["t_s"] <= departure["gone_s"]
                                        and e["kind"] not in ("state", "health")])
    return rows


def server_log_lines(path: Path, needle: str, limit: int = 12) -> list[str]:
    """The server log's lines that name `needle` (a worker id), the last `limit` of them."""
    if not path.is_file():
        return []
    lines = [line.rstrip() for line in path.read_text(errors="replace").splitlines() if needle in line]
    return [line[:400] for line in lines[-limit:]]
