"""restart_supervisor: the gateway's supervisor process (`pdserve serve`) stopped and started again over its
named fleet, in turn with the same settings and with changed ones (`--ratio auto` or `--ratio fixed`, the
opposite of the controller's state then: a setting the rejoin applies).

The supervisor is stopped with SIGINT, as an operator or a rolling update would: its frontends stop (every
connection is cut: FrontendCut with until_s), the named fleet and its workers go on. The same command,
started again, must rejoin that fleet, not start another: no worker may be replaced for it (departures.py
does not count this fault among those that may kill a worker), and it must print which changed settings it
applied. Its time to /health 200 is the recovery time. PUTs in flight are let answer first.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.frontends import FrontendCut, FrontendMap
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.watch import PoolWatch


@dataclass
class SupervisorRestarts:
    config: ChaosConfig
    target: ChaosTarget
    log: ChaosLog
    watch: PoolWatch
    frontends: FrontendMap
    restarts: list[dict[str, Any]] = field(default_factory=list)
    _extra: tuple[str, ...] = ()

    async def restart(self) -> str:
        if self.target.restart_server is None:
            return "skipped (the run cannot restart its server)"
        changed = len(self.restarts) % 2 == 1  # same, changed, same (as changed), changed again, ...
        if changed:  # the opposite of the controller's state now (a PUT may have turned it either way)
            self._extra = ("--ratio", "fixed" if self.watch.pools.get("auto") else "auto")
        ports = frozenset(p for pid in self.target.frontend_pids() for p in self.frontends.ports_of(pid))
        pid = self.target.gateway_pid_now()
        log_size = self.target.server_log.stat().st_size if self.target.server_log else 0
        started = self.log.now()
        cut = FrontendCut("restart_supervisor", pid, started, ports, until_s=float("inf"))
        self.frontends.cuts.append(cut)
        self.watch.is_fleet_down = self.watch.is_gateway_restarting = True
        try:
            to_healthy_s = await asyncio.to_thread(self.target.restart_server, self._extra)
        finally:
            self.watch.is_fleet_down = self.watch.is_gateway_restarting = False
            self.frontends.cuts[self.frontends.cuts.index(cut)] = FrontendCut(
                cut.kind, cut.pid, cut.start_s, cut.ports, until_s=self.log.now())
        notes = self._notes(log_size)
        row = {"pid": pid, "settings": "changed" if changed else "same", "extra_args": list(self._extra),
               "to_healthy_s": round(to_healthy_s, 2), "notes": notes, "num_connections": len(ports),
               "start_s": round(started, 3), "end_s": round(self.log.now(), 3)}
        self.restarts.append(row)
        self.log.event("restart_supervisor", **row)
        rejoined = any("rejoined fleet" in n for n in notes)
        if not rejoined:
            self.log.violate("supervisor_rejoins", f"the supervisor restarted at t={started:.1f} s did not "
                             f"rejoin its fleet: {notes}", **row)
        if changed and not any("applied" in n for n in notes):
            self.log.violate("supervisor_rejoins", f"the restart at t={started:.1f} s changed "
                             f"{' '.join(self._extra)} and printed no note that it was applied", **row)
        return f"{row['settings']}, {'rejoined' if rejoined else 'NOT rejoined'} in {to_healthy_s:.1f} s"

    def _notes(self, since_byte: int) -> list[str]:
        """The supervisor's lines about its fleet since the restart (server.log)."""
        if self.target.server_log is None:
            return []
        with self.target.server_log.open("rb") as log:
            log.seek(since_byte)
            text = log.read().decode(errors="replace")
        return [line.strip()[:200] for line in text.splitlines()
                if re.match(r"\s*pdserve: (rejoined|fleet )", line)]

