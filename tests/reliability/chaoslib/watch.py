"""PoolWatch: GET /admin/pools and /health every watch_every_s, the gateway's RSS every rss_every_s.

Invariants it checks while the run goes on:
  - no worker stays outside `active` (starting, pending, draining, changing_role, failed) longer than
    state_bound_s plus the grace of the change that moved it (at most the drain timeout), or start_bound_s
    while it is only being placed and started (a replacement loading its model);
  - /admin/pools answers (unreachable for longer than state_bound_s is a violation; not while the driver
    has killed the fleet actor on purpose: is_fleet_down, its own bound applies).
It also keeps the latest /admin/pools body for the driver (which workers are busy, their pids), and every
worker's id and pid over time (departures.WorkerLedger: which were replaced, checked at the end).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.departures import WorkerLedger
from tests.reliability.chaoslib.log import ChaosLog


@dataclass
class PoolWatch:
    config: ChaosConfig
    target: ChaosTarget
    client: httpx.AsyncClient
    log: ChaosLog
    pools: dict[str, Any] = field(default_factory=dict)  # the latest GET /admin/pools body
    extra_bound_s: float = 0.0  # the grace of the layout change applying now (set by the driver)
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (t_s, gateway RSS)
    health: str = ""
    is_fleet_down: bool = False  # the driver killed the fleet actor and waits for it (fleet_faults.py)
    is_gateway_restarting: bool = False  # the driver restarts the supervisor (supervisor.py)
    # (worker id, pid) → [(t_s, RSS MiB)]: each worker process's own, from the pids /admin/pools lists
    worker_rss_mib: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    # ("supervisor" or "frontend", pid) → [(t_s, RSS MiB)]: each gateway process's own. The sum above changes
    # its set of processes with every frontend or supervisor restart, so only these show a leak.
    gateway_rss_by_process: dict[tuple[str, int], list[tuple[float, float]]] = field(default_factory=dict)
    ledger: WorkerLedger = field(default_factory=WorkerLedger)
    _outside: dict[str, dict[str, Any]] = field(default_factory=dict)  # worker id → its time outside active
    _unreachable_since: float | None = None

    async def fetch_pools(self) -> dict[str, Any]:
        response = await self.client.get("/admin/pools", timeout=15)
        response.raise_for_status()
        self.pools = dict(response.json())
        return self.pools

    async def watch_forever(self, rss_every_s: float = 2.0) -> None:
        next_rss = 0.0
        while True:
            if self.log.now() >= next_rss:
                self.sample_rss()
                next_rss = self.log.now() + rss_every_s
            try:
                await self.look()
            except Exception as error:  # one missed look must not end the watch
                self.log.event("watch_error", error=f"{type(error).__name__}: {error}")
            await asyncio.sleep(self.config.watch_every_s)

    def sample_rss(self) -> None:
        """The gateway's RSS: its process's, plus its frontends' (each restarted one counts from anew); and
        each worker's."""
        self._sample_workers()
        if self.is_gateway_restarting:
            return
        try:
            gateway = psutil.Process(self.target.gateway_pid_now())
            if gateway.status() == psutil.STATUS_ZOMBIE:  # exited, not reaped yet (our child)
                raise psutil.NoSuchProcess(gateway.pid)
            rss = gateway.memory_info().rss
            self._note_gateway_process("supervisor", gateway.pid, rss)
        except psutil.NoSuchProcess:
            if not any(v["invariant"] == "gateway_alive" for v in self.log.violations):
                self.log.violate("gateway_alive", "the gateway process is gone",
                                 recent_actions=self.log.recent(60.0))
            return
        for pid in self.target.frontend_pids():
            try:
                frontend_rss = psutil.Process(pid).memory_info().rss
            except psutil.NoSuchProcess:  # killed by a fault just now
                continue
            self._note_gateway_process("frontend", pid, frontend_rss)
            rss += frontend_rss
        self.rss_mib.append((self.log.now(), rss / 2**20))

    def _note_gateway_process(self, kind: str, pid: int, rss: int) -> None:
        self.gateway_rss_by_process.setdefault((kind, pid), []).append((self.log.now(), rss / 2**20))

    def _sample_workers(self) -> None:
        now = self.log.now()
        for worker in self.pools.get("workers", []):
            pid = worker.get("pid")
            if not pid or not self.target.owns(int(pid)):
                continue
            try:
                rss = psutil.Process(int(pid)).memory_info().rss
            except psutil.NoSuchProcess:
                continue
            self.worker_rss_mib.setdefault((worker["worker_id"], int(pid)), []).append((now, rss / 2**20))

    async def look(self) -> None:
        try:
            pools = await self.fetch_pools()
            status = (await self.client.get("/health", timeout=15)).json().get("status", "?")
        except (httpx.HTTPError, ValueError) as error:
            now = self.log.now()
            if self.is_fleet_down:
                self._unreachable_since = None
                return
            self._unreachable_since = self._unreachable_since if self._unreachable_since is not None else now
            if now - self._unreachable_since > self.config.state_bound_s:
                self.log.violate("admin_answers", f"/admin/pools or /health unanswered for "
                                 f"{now - self._unreachable_since:.0f} s: {type(error).__name__}")
                self._unreachable_since = now
            return
        self._unreachable_since = None
        self.ledger.observe(self.log.now(), pools)
        if status != self.health:
            self.log.event("health", status=status)
            self.health = status
        self.check_states(pools)

    def check_states(self, pools: dict[str, Any]) -> None:
        now, seen = self.log.now(), set()
        bound_s = self.config.state_bound_s + min(self.extra_bound_s, self.config.drain_timeout_s)
        for worker in pools.get("workers", []):
            worker_id, state = worker["worker_id"], worker["state"]
            seen.add(worker_id)
            episode = self._outside.get(worker_id)
            if state == "active":
                if episode is not None:
                    self.log.event("state", worker_id=worker_id, state="active",
                                   after_s=round(now - episode["since"], 2), was=episode["states"])
                    del self._outside[worker_id]
                continue
            if episode is None:
                episode = self._outside[worker_id] = {"since": now, "states": [], "reported": False}
            if not episode["states"] or episode["states"][-1] != state:
                episode["states"].append(state)
                self.log.event("state", worker_id=worker_id, state=state, role=worker.get("role"),
                               next_role=worker.get("next_role"))
            is_starting = set(episode["states"]) <= {"pending", "starting"}
            its_bound_s = max(bound_s, self.config.start_bound_s) if is_starting else bound_s
            if not episode["reported"] and now - episode["since"] > its_bound_s:
                episode["reported"] = True
                self.log.violate(
                    "worker_back_to_active",
                    f"{worker_id} ({worker.get('role')}, next {worker.get('next_role')}) outside active "
                    f"({' → '.join(episode['states'])}) for {now - episode['since']:.0f} s > "
                    f"{its_bound_s:.0f} s",
                    worker=worker, since_s=round(episode["since"], 2), pools_status=pools.get("status"),
                    change_in_progress=pools.get("change_in_progress"), auto=pools.get("auto"),
                    recent_actions=self.log.recent(60.0))
        for worker_id in set(self._outside) - seen:  # drained away or replaced: the episode ends
            episode = self._outside.pop(worker_id)
            self.log.event("state", worker_id=worker_id, state="gone",
                           after_s=round(now - episode["since"], 2), was=episode["states"])

    def stuck_now(self) -> list[str]:
        return sorted(self._outside)
