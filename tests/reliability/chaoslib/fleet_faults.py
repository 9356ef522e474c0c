"""Faults of the fleet actor's process and of a worker's, by signal (only a pid of this run's own server).

  kill_fleet    SIGKILL the fleet actor (restarted by Ray); its workers live on, and the supervisor starts
                its fleet again over them (gateway/fleet/adoption.py: no weights load). Probed on fresh
                connections every 0.5 s: /health must answer 503 within health_down_s ("/health tells the
                truth"), and the fleet must serve again within fleet_recovery_s: /health 200 four times in
                a row and /admin/pools answering with every worker active; every worker active at the kill
                must be among them, the same one ("fleet_adopts_workers"). Meanwhile the watch does not
                count /admin/pools' silence (the fleet is down on purpose).
  pause_fleet   SIGSTOP the fleet actor for 6 or 12 s (in turn: 12 s is past the frontends' 10 s lease of
                the fleet's silence), then SIGCONT: nothing may be replaced because of it
                (tests/reliability/chaoslib/departures.py); whether /health said 503 meanwhile is noted.
  pause_worker  SIGSTOP a busy worker for 8 s, then SIGCONT (a hung worker): the fleet may replace it or
                not; its requests must end within their deadlines like any other.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.watch import PoolWatch

PROBE_EVERY_S = 0.5
HEALTHY_IN_A_ROW = 4  # fresh connections: both frontends answer among them, most likely
FLEET_PAUSES_S = (6.0, 12.0)
WORKER_PAUSE_S = 8.0


@dataclass
class FleetFaults:
    config: ChaosConfig
    target: ChaosTarget
    client: httpx.AsyncClient
    log: ChaosLog
    watch: PoolWatch
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # one per kill_fleet
    num_fleet_pauses: int = 0  # pause_fleet takes FLEET_PAUSES_S in turn

    def _fleet(self) -> psutil.Process | None:
        pid = self.target.fleet_pid()
        if pid is None or not self.target.owns(pid):
            self.log.event("fleet_fault_skipped", why=f"no fleet actor process of this run (pid {pid})")
            return None
        try:
            return psutil.Process(pid)
        except psutil.NoSuchProcess:
            return None

    async def _health(self) -> int | None:
        try:
            return (await self.client.get("/health", timeout=5)).status_code
        except httpx.HTTPError:
            return None

    async def _serves_again(self) -> set[str] | None:
        """The ids of the workers once /admin/pools answers with every worker active; else None."""
        try:
            pools = await self.watch.fetch_pools()
        except (httpx.HTTPError, ValueError):
            return None
        workers = pools.get("workers", [])
        if not workers or any(w["state"] != "active" for w in workers):
            return None
        return {w["worker_id"] for w in workers}

    async def kill_fleet(self) -> str:
        fleet = self._fleet()
        if fleet is None:
            return "skipped (no fleet actor)"
        before = {w["worker_id"] for w in self.watch.pools.get("workers", []) if w["state"] == "active"}
        self.watch.is_fleet_down = True
        fleet.kill()
        started = self.log.now()
        down_s: float | None = None
        recovered_s: float | None = None
        in_a_row = 0
        after: set[str] | None = None
        try:
            while self.log.now() - started < self.config.fleet_recovery_s:
                status = await self._health()
                elapsed = self.log.now() - started
                if status == 503 and down_s is None:
                    down_s = elapsed
                in_a_row = in_a_row + 1 if status == 200 else 0
                if in_a_row >= HEALTHY_IN_A_ROW and (after := await self._serves_again()) is not None:
                    recovered_s = self.log.now() - started
                    break
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            self.watch.is_fleet_down = False
        row = {"pid": fleet.pid, "start_s": round(started, 3), "to_503_s": _round(down_s),
               "to_healthy_s": _round(recovered_s), "end_s": round(self.log.now(), 3),
               "adopted": sorted(before & (after or set())), "lost": sorted(before - (after or set()))}
        self.recoveries.append(row)
        self.log.event("kill_fleet", **row)
        killed = f"the fleet actor was killed at t={started:.1f} s"
        if down_s is None or down_s > self.config.health_down_s:
            said = f"answered 503 only after {down_s:.1f} s" if down_s is not None else "never answered 503"
            self.log.violate("health_tells_truth",
                             f"{killed}: /health {said} (bound {self.config.health_down_s:g} s)", **row)
        if recovered_s is None:
            self.log.violate("fleet_recovers",
                             f"{killed}: not serving again after {self.config.fleet_recovery_s:g} s", **row)
            return "killed, not recovered"
        if row["lost"]:
            self.log.violate("fleet_adopts_workers", f"{killed}: the restarted fleet lost the workers "
                             f"{', '.join(row['lost'])} that were active (every one should live on)", **row)
            return "killed, recovered without some of its workers"
        return f"killed, recovered with its {len(before)} workers"

    async def pause_fleet(self) -> str:
        fleet = self._fleet()
        if fleet is None:
            return "skipped (no fleet actor)"
        pause_s = FLEET_PAUSES_S[self.num_fleet_pauses % len(FLEET_PAUSES_S)]
        self.num_fleet_pauses += 1
        fleet.suspend()
        started = self.log.now()
        statuses: set[int | None] = set()
        try:
            while self.log.now() - started < pause_s:
                statuses.add(await self._health())
                await asyncio.sleep(PROBE_EVERY_S)
        finally:
            fleet.resume()
        self.log.event("pause_fleet", pid=fleet.pid, pause_s=pause_s, saw_503=503 in statuses,
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        return "paused, /health said 503" if 503 in statuses else "paused, /health stayed 200"

    async def pause_worker(self, victim: dict[str, Any]) -> str:
        """SIGSTOP `victim` (a worker from /admin/pools) for WORKER_PAUSE_S."""
        pid = int(victim["pid"])
        if not self.target.owns(pid):
            self.log.event("pause_worker_skipped", why=f"pid {pid} is not a process of this run")
            return "skipped (not ours)"
        try:
            worker = psutil.Process(pid)
            worker.suspend()
        except psutil.NoSuchProcess:
            return "skipped (gone)"
        started = self.log.now()
        await asyncio.sleep(WORKER_PAUSE_S)
        try:
            worker.resume()
            result = "resumed"
        except psutil.NoSuchProcess:  # the fleet took it for hung and replaced it
            result = "replaced meanwhile"
        self.log.event("pause_worker", worker_id=victim["worker_id"], role=victim["role"], pid=pid,
                       running=victim.get("running_requests"), pause_s=WORKER_PAUSE_S, result=result,
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        return f"{victim['role']}, {result}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)
