"""(Over 300 lines: the table of fault kinds and each kind's injection, read together.)

FaultDriver: one fault every [fault_min_s, fault_max_s] while the traffic runs, drawn by weight.

  kill_busy           SIGKILL the process of a worker with running or waiting requests right now (its pid from
                      /admin/pools; only a pid of this run's own server is ever signalled); the first one
                      at first_kill_s goes to a worker that is decoding
  put_layout          PUT a random valid layout (2..max_workers workers), a small drain grace; not awaited,
                      so that the other faults land while it applies
  auto_on, auto_off   PUT {"auto": true|false}
  auto_off_mid_move   auto on over a disaggregated layout, wait until the controller moves a worker, then
                      auto off while it does
  grace_past_timeout  PUT a layout with drain_grace_s past the drain timeout: refused (4xx), or applied
                      within the bounds like any other change
With several frontends (ChaosConfig.num_frontends > 1), also (FRONTENDS_ONLY):
  kill_frontend, pause_frontend   tests/reliability/chaoslib/frontends.py
  kill_fleet, pause_fleet         chaoslib/fleet_faults.py (a killed fleet is waited for: its
                                  recovery is measured, no other fault meanwhile)
  pause_worker                    SIGSTOP a busy worker for 8 s (fleet_faults.py)
  loop_burst                      large distinct schemas and MiB-sized /tokenize at once (burst.py)
  restart_supervisor              stop `pdserve serve` and start it again over its fleet (supervisor.py)
  salted_tenants                  one prompt under two cache salts shares no block (tenants.py)
  hang_step, step_error, query_of_death, stall_pulls, lost_release, mismatched_peer, forged_claim
                                  inside the workers and their transfers (worker_faults.py)
Each drawable kind is drawn at least min_each_fault times where the run's time allows: once the kinds
still short of it need half the draws the rest of the run is likely to have, they are drawn first.
Every PUT must answer within state_bound_s (+ its grace, at most the drain timeout) + 60 s, and never with a
connection error unless a frontend fault struck its connection. The last layout answered 200 with no error
is the one the end check expects (after a fleet kill: the layout the fleet started again with).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.chaoslib.burst import LoopBurst
from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.connections import PORTS
from tests.reliability.chaoslib.fleet_faults import FleetFaults
from tests.reliability.chaoslib.frontends import FrontendMap
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.supervisor import SupervisorRestarts
from tests.reliability.chaoslib.tenants import SaltedTenants
from tests.reliability.chaoslib.watch import PoolWatch
from tests.reliability.chaoslib.worker_faults import KINDS as WORKER_FAULT_KINDS
from tests.reliability.chaoslib.worker_faults import WorkerFaults

# Of the fault kinds; ChaosConfig.skip_faults leaves some out. One process draws the first six only.
WEIGHTS = {"kill_busy": 0.3, "put_layout": 0.25, "auto_on": 0.08, "auto_off": 0.07,
           "auto_off_mid_move": 0.2, "grace_past_timeout": 0.1,
           "kill_frontend": 0.1, "pause_frontend": 0.12, "loop_burst": 0.1, "kill_fleet": 0.06,
           "pause_fleet": 0.08, "pause_worker": 0.1,
           "hang_step": 0.06, "step_error": 0.06, "query_of_death": 0.05, "stall_pulls": 0.06,
           "lost_release": 0.05, "mismatched_peer": 0.04, "forged_claim": 0.04, "restart_supervisor": 0.04,
           "salted_tenants": 0.06}
# Drawn only against several frontends and a fleet actor (a paused worker and a burst make sense in one
# process too, but one process's run stays as it was).
FRONTENDS_ONLY = ("kill_frontend", "pause_frontend", "loop_burst", "kill_fleet", "pause_fleet",
                  "pause_worker", "restart_supervisor", "salted_tenants", *WORKER_FAULT_KINDS)
ROLES = ("prefill", "decode", "mixed")


def drawable(config: ChaosConfig) -> list[str]:
    return [k for k in WEIGHTS if k not in config.skip_faults
            and (config.has_frontends or k not in FRONTENDS_ONLY)]


def valid_layouts(max_workers: int) -> list[dict[str, int]]:
    """Every layout of 2..max_workers workers that can prefill and decode."""
    return [{"prefill": p, "decode": d, "mixed": m}
            for n in range(2, max_workers + 1) for p in range(n + 1) for d in range(n + 1 - p)
            for m in (n - p - d,) if p + m >= 1 and d + m >= 1]


@dataclass
class FaultDriver:
    config: ChaosConfig
    target: ChaosTarget
    client: httpx.AsyncClient
    log: ChaosLog
    watch: PoolWatch
    rng: random.Random
    frontends: FrontendMap | None  # several frontends only
    fleet: FleetFaults
    burst: LoopBurst
    workers: WorkerFaults
    supervisor: SupervisorRestarts | None  # several frontends only
    tenants: SaltedTenants
    faults: Counter[str] = field(default_factory=Counter)  # by kind and result, e.g. "kill_busy:decode"
    injected: Counter[str] = field(default_factory=Counter)  # by kind, those not skipped
    last_accepted: dict[str, int] | None = None  # the layout of the last PUT answered 200 with no error
    put_errors: list[dict[str, Any]] = field(default_factory=list)  # PUTs answered 200 with an error
    _puts: list[asyncio.Task[int | None]] = field(default_factory=list)
    _graces: list[float] = field(default_factory=list)  # of the PUTs in flight

    async def drive(self, until_s: float) -> None:
        await asyncio.sleep(max(0.0, self.config.first_kill_s - self.log.now()))
        if "kill_busy" not in self.config.skip_faults:
            await self.kill_busy(decoding=True, wait_s=15.0)
        kinds = drawable(self.config)
        while True:
            await asyncio.sleep(self.rng.uniform(self.config.fault_min_s, self.config.fault_max_s))
            if self.log.now() >= until_s:
                return
            if not kinds:  # every kind skipped: traffic alone
                continue
            kind = self._draw(kinds, until_s)
            try:
                if kind in FRONTENDS_ONLY:
                    result = await self._process_fault(kind)
                    self.faults[f"{kind}:{result}"] += 1
                    self.injected[kind] += not result.startswith("skipped")
                    continue
                self.injected[kind] += 1
                if kind == "kill_busy":
                    if not await self.kill_busy():
                        self.injected[kind] -= 1
                elif kind == "put_layout":
                    self.put_layout(self.rng.choice((0.0, 0.5, 2.0, 5.0)), kind)
                elif kind in ("auto_on", "auto_off"):
                    await self.set_auto(kind == "auto_on", kind)
                elif kind == "auto_off_mid_move":
                    await self.auto_off_mid_move()
                else:
                    grace = self.rng.uniform(self.config.drain_timeout_s + 1, 3600.0)
                    self.put_layout(grace, kind, differ=True)
            except (httpx.HTTPError, ValueError, KeyError) as error:  # answers are checked elsewhere
                self.log.event("driver_error", fault=kind, error=f"{type(error).__name__}: {error}")

    def _draw(self, kinds: list[str], until_s: float) -> str:
        """By weight; kinds short of min_each_fault first once they need half the draws likely left."""
        short = {k: self.config.min_each_fault - self.injected[k] for k in kinds
                 if self.injected[k] < self.config.min_each_fault}
        num_drawn = sum(self.injected.values())
        if short and num_drawn:
            draws_left = (until_s - self.log.now()) * num_drawn / max(self.log.now(), 1.0)
            if sum(short.values()) >= draws_left / 2:
                return self.rng.choice(sorted(short))
        return self.rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]

    async def _process_fault(self, kind: str) -> str:
        """One of FRONTENDS_ONLY; returns its result ("skipped ..." when nothing was done)."""
        if kind == "loop_burst":
            return self.burst.start()
        if kind == "pause_worker":
            victim = await self._busy_worker(decoding=False, wait_s=3.0)
            return await self.fleet.pause_worker(victim) if victim else "skipped (no busy worker)"
        if kind == "kill_fleet":  # let the PUTs in flight answer first: the fleet would take them along
            await asyncio.gather(*self._puts, return_exceptions=True)
            result = await self.fleet.kill_fleet()
            with contextlib.suppress(httpx.HTTPError, ValueError):  # not back: a violation already
                pools = await self.watch.fetch_pools()
                self.last_accepted = {role: int(pools.get(role, 0)) for role in ROLES}  # as it restarted
            return result
        if kind == "pause_fleet":
            return await self.fleet.pause_fleet()
        if kind == "salted_tenants":
            return await self.tenants.probe()
        if kind == "restart_supervisor":  # as kill_fleet: the PUTs in flight answer first
            await asyncio.gather(*self._puts, return_exceptions=True)
            assert self.supervisor is not None, "a supervisor restart needs several frontends"
            return await self.supervisor.restart()
        if kind in WORKER_FAULT_KINDS:
            return await self.workers.inject(kind)
        assert self.frontends is not None, "frontend faults need several frontends"
        return await (self.frontends.kill_frontend() if kind == "kill_frontend"
                      else self.frontends.pause_frontend())

    # --- kills -------------------------------------------------------------------------------------------
    async def _busy_worker(self, decoding: bool, wait_s: float) -> dict[str, Any] | None:
        """A worker with requests running or waiting now (decoding: one running decode streams), waiting up to
        `wait_s` for one."""
        waited = 0.0
        while True:
            pools = await self.watch.fetch_pools()
            busy = [w for w in pools.get("workers", []) if w.get("pid")
                    and w["state"] in ("active", "draining", "changing_role")
                    and w.get("running_requests", 0) + w.get("waiting_requests", 0) > 0
                    and (not decoding or (w["role"] != "prefill" and w.get("running_requests", 0) > 0))]
            if busy or waited >= wait_s:
                break
            await asyncio.sleep(0.1)
            waited += 0.1
        return self.rng.choice(busy) if busy else None

    async def kill_busy(self, decoding: bool = False, wait_s: float = 3.0) -> bool:
        """SIGKILL a worker with requests running or waiting now (decoding: one running decode streams)."""
        victim = await self._busy_worker(decoding, wait_s)
        if victim is None:
            self.faults["kill_busy:skipped (no busy worker)"] += 1
            self.log.event("kill_skipped", why="no worker with running or waiting requests")
            return False
        pid = int(victim["pid"])
        if not self.target.owns(pid):  # the machine is shared: never signal a process not of this run
            self.log.event("kill_skipped", why=f"pid {pid} is not a process of this run", worker=victim)
            return False
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.log.event("kill_skipped", why=f"pid {pid} already gone", worker=victim)
            return False
        self.faults[f"kill_busy:{victim['role']}"] += 1
        self.log.event("kill", worker_id=victim["worker_id"], role=victim["role"], state=victim["state"],
                       pid=pid, running=victim.get("running_requests"),
                       waiting=victim.get("waiting_requests"))
        return True

    # --- layout changes ----------------------------------------------------------------------------------
    def put_layout(self, grace_s: float, kind: str, differ: bool = False) -> None:
        current = {role: int(self.watch.pools.get(role, 0)) for role in ROLES}
        layouts = [x for x in valid_layouts(self.config.max_workers) if not differ or x != current]
        layout = self.rng.choice(layouts)
        self._puts.append(asyncio.create_task(self._put({**layout, "drain_grace_s": grace_s}, kind)))

    async def _put(self, body: dict[str, Any], kind: str) -> int | None:
        """One PUT /admin/pools, checked and tallied; returns its status (None: unanswered)."""
        grace_s = float(body.get("drain_grace_s", 0.0))
        bound_s = self.config.state_bound_s + min(grace_s, self.config.drain_timeout_s) + 60.0
        self._graces.append(grace_s)
        self.watch.extra_bound_s = max(self._graces)
        sent = self.log.now()
        ports: list[int] = []
        PORTS.set(ports)
        try:
            async with asyncio.timeout(bound_s):
                response = await self.client.put("/admin/pools", json=body, timeout=None)
        except TimeoutError:
            self.faults[f"{kind}:unanswered"] += 1
            self.log.violate("put_answers", f"PUT /admin/pools {body} unanswered after {bound_s:.0f} s",
                             recent_actions=self.log.recent(bound_s))
            return None
        except httpx.HTTPError as error:  # what it changed is unknown: the end check expects the final PUT's
            cut = self.frontends.cut_of(ports[-1] if ports else None, sent, self.log.now()) if (
                self.frontends is not None) else None
            self.faults[f"{kind}:{'cut by a frontend fault' if cut else 'connection failed'}"] += 1
            self.log.event("put", fault=kind, body=body, status=None, error=f"{type(error).__name__}",
                           cut_by=cut and f"{cut.kind} of {cut.pid}", seconds=round(self.log.now() - sent, 2))
            if cut is None:
                self.log.violate("put_answers", f"PUT /admin/pools {body}: the connection failed without "
                                 f"an answer: {type(error).__name__}: {error}",
                                 recent_actions=self.log.recent())
            return None
        finally:
            self._graces.remove(grace_s)
            self.watch.extra_bound_s = max(self._graces, default=0.0)
        answer: dict[str, Any] = response.json() if response.headers.get("content-type", "").startswith(
            "application/json") else {}
        layout = {role: int(body.get(role, 0)) for role in ROLES} if set(ROLES) & set(body) else {}
        row = self.log.event("put", fault=kind, body=body, status=response.status_code,
                             seconds=round(self.log.now() - sent, 2), error=answer.get("error"),
                             done=answer.get("done"))
        result = {200: "applied", 400: "refused", 409: "conflict"}.get(response.status_code,
                                                                       f"http_{response.status_code}")
        if response.status_code == 200 and answer.get("error"):
            result = "applied_with_error"
            self.put_errors.append(row)
        elif response.status_code == 200 and layout:
            self.last_accepted = layout
        if response.status_code == 422 and kind == "grace_past_timeout":
            result = "refused"
        self.faults[f"{kind}:{result}"] += 1
        if response.status_code >= 500:
            self.log.violate("put_answers", f"PUT /admin/pools {body} answered {response.status_code}",
                             answer=response.text[:500])
        return response.status_code

    async def set_auto(self, on: bool, kind: str) -> None:
        await self._put({"auto": on}, kind)

    async def auto_off_mid_move(self) -> None:
        """Auto on over a layout with a prefill worker (so the controller has a rung to move down), wait for
        its move to start, then auto off while the worker is draining or changing role."""
        pools = await self.watch.fetch_pools()
        num_workers = pools.get("prefill", 0) + pools.get("decode", 0) + pools.get("mixed", 0)
        if not pools.get("prefill") or pools.get("mixed"):
            if any(not task.done() for task in self._puts):
                self.faults["auto_off_mid_move:skipped (a change is applying)"] += 1
                return
            num_workers = max(2, min(num_workers, self.config.max_workers))
            await self._put({"prefill": 1, "decode": num_workers - 1, "drain_grace_s": 0.0},
                             "auto_off_mid_move(setup)")
        already = {w["worker_id"] for w in pools.get("workers", []) if w["state"] != "active"}
        await self._put({"auto": True}, "auto_off_mid_move(on)")
        caught: list[dict[str, Any]] = []
        for _ in range(int(30 / 0.1)):  # a move of the controller's own: not a worker stuck from before
            pools = await self.watch.fetch_pools()
            caught = [w for w in pools.get("workers", []) if w["worker_id"] not in already
                      and w["state"] in ("changing_role", "draining")]
            if caught:
                break
            await asyncio.sleep(0.1)
        await self._put({"auto": False}, "auto_off_mid_move(off)")
        self.faults[f"auto_off_mid_move:{'mid-move' if caught else 'no move seen in 30 s'}"] += 1
        self.log.event("auto_off_mid_move",
                       caught=[(w["worker_id"], w["role"], w["state"], w.get("next_role")) for w in caught])

    async def finish(self, final_layout: dict[str, int]) -> int | None:
        """Let the PUTs in flight answer, turn auto off, wait (up to state_bound_s) until no worker is
        starting, then set `final_layout` (retried while a change applies): what the end check expects."""
        await asyncio.gather(*self._puts, return_exceptions=True)
        await self._put({"auto": False}, "final")
        for _ in range(int(self.config.state_bound_s)):  # a starting replacement would fail it (F2)
            pools = await self.watch.fetch_pools()
            if not any(w["state"] in ("pending", "starting") for w in pools.get("workers", [])):
                break
            await asyncio.sleep(1.0)
        status = None
        for _ in range(60):
            status = await self._put({**final_layout, "drain_grace_s": 0.0}, "final")
            if status not in (409, None):
                break
            await asyncio.sleep(1.0)
        return status
