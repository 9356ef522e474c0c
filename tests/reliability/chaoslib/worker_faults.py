"""Faults planted inside the workers (through Ray, tests/reliability/chaoslib/injectors.py and
tests/helpers/actor_faults.py), and in the KV transfers between them; only workers of this run's own fleet.

  hang_step        a busy decode worker's next step waits at a gate (no error, no dead process): the fleet's
                   step watchdog (`--step-watchdog-s`) must take it for hung and replace it, its requests
                   moving on; released after HANG_WAIT_S if it was not replaced (noted, not a violation: the
                   requests' deadlines still bound it)
  step_error       a busy worker's steps raise from now on (an intermittent fault, once per draw): the worker
                   is replaced and its requests move or retry
  query_of_death   every decode-capable worker raises in any step holding one request (by its seed); that
                   request is sent beside the traffic: it must end with a clear error or on a replacement
                   that lacks the fault, and no other request may fail for it (run.py checks `worker_failed`
                   errors inside the window); at most one worker more than it broke is replaced
  stall_pulls      every decode worker's pulls started in the next STALL_S
                   are posted and never heard of again (a lost claim or grant; a READ that hangs): each
                   ends by its deadline, its request recomputed
  lost_release     a prefill worker's explicit releases are lost and its leases shortened to 1 s (a mixed
                   worker's: its migration sender's) for LEASE_FAULT_S (handles expire before they are
                   pulled): the leases free the blocks, and requests whose handle expired are recomputed;
                   0 blocks used at the end
  mismatched_peer  each decode worker is offered a sender with another KV layout: refused in the call, the
                   worker serves on (a violation if accepted)
  forged_claim     each decode worker claims transfer ids its senders never issued or released long ago:
                   the senders refuse, nobody dies
Each logs an event with the workers it touched (start_s/end_s), which departures.py reads to explain a
worker replaced after hang_step, step_error or query_of_death; the others may replace no worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.watch import PoolWatch

RAY_NAMESPACE = "pdserve"  # gateway/lifespans.py's: the workers' actors are named in it
CALL_TIMEOUT_S = 20.0
HANG_WAIT_S = 75.0  # the watchdog's floor (chaos serves with --step-watchdog-s 10) + the load poll, and room
STALL_S = 6.0
TRANSFER_TIMEOUT_S = 10.0  # a pull's own bound (kv_transfer's default transfer_timeout_s)
LEASE_FAULT_S = 8.0
QUERY_OF_DEATH_SEED_BASE = 9_000_000  # far from the traffic's seeds (its request indices)
KINDS = ("hang_step", "step_error", "query_of_death", "stall_pulls", "lost_release", "mismatched_peer",
         "forged_claim")


def _actor_faults() -> Any:
    from tests.helpers import actor_faults  # imports ray: only once connected

    return actor_faults


def _injectors() -> Any:
    from tests.reliability.chaoslib import injectors  # imports ray: only once connected

    return injectors


@dataclass
class WorkerFaults:
    config: ChaosConfig
    target: ChaosTarget
    client: httpx.AsyncClient
    log: ChaosLog
    watch: PoolWatch
    model: str
    rng: random.Random
    windows: list[tuple[float, float, int]] = field(default_factory=list)  # query_of_death: start, end, seed
    _is_connected: bool = False

    def connect(self) -> None:
        """Join the run's Ray cluster as a driver, in the workers' namespace (blocking: call it in a thread,
        before the traffic starts). Ray is imported here only, after the token mode is set: the run's head
        requires its token (RAY_AUTH_TOKEN, set by soaklib/cluster.py)."""
        if self._is_connected or self.target.ray_address is None:
            return
        os.environ["RAY_AUTH_MODE"] = "token"
        import ray

        ray.init(address=self.target.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
        self._is_connected = True

    async def _call(self, worker_id: str, fn: Any, *args: Any) -> Any:
        if not self._is_connected:
            raise RuntimeError("not connected to the run's Ray cluster")
        from gateway.fleet.adoption import worker_actor  # a fleet actor's workers carry its name

        actor = worker_actor(worker_id)
        return await asyncio.wait_for(actor.__ray_call__.remote(fn, *args), CALL_TIMEOUT_S)

    def _workers(self, roles: tuple[str, ...], busy: bool = False) -> list[dict[str, Any]]:
        return [w for w in self.watch.pools.get("workers", [])
                if w["role"] in roles and w["state"] == "active"
                and (not busy or w.get("running_requests", 0) + w.get("waiting_requests", 0) > 0)
                and w.get("pid") and self.target.owns(int(w["pid"]))]

    async def _busy(self, roles: tuple[str, ...], wait_s: float = 5.0) -> dict[str, Any] | None:
        for _ in range(int(wait_s / 0.2)):
            await self.watch.fetch_pools()
            busy = self._workers(roles, busy=True)
            if busy:
                return self.rng.choice(busy)
            await asyncio.sleep(0.2)
        return None

    async def inject(self, kind: str) -> str:
        try:
            return await getattr(self, kind)()
        except Exception as error:  # an actor gone meanwhile (another fault): not this fault's result
            self.log.event("worker_fault_failed", fault=kind, error=f"{type(error).__name__}: {error}"[:300])
            return f"skipped ({type(error).__name__})"

    async def _gone(self, worker_id: str, within_s: float) -> float | None:
        started = self.log.now()
        while self.log.now() - started < within_s:
            await asyncio.sleep(0.5)
            pools = await self.watch.fetch_pools()
            if worker_id not in {w["worker_id"] for w in pools.get("workers", [])}:
                return self.log.now() - started
        return None

    async def hang_step(self) -> str:
        victim = await self._busy(("decode", "mixed"))
        if victim is None:
            return "skipped (no busy decode worker)"
        started = self.log.now()
        await self._call(victim["worker_id"], _actor_faults().hold_steps)
        gone_s = await self._gone(victim["worker_id"], HANG_WAIT_S)
        if gone_s is None:
            await self._call(victim["worker_id"], _actor_faults().release_steps)
        self.log.event("hang_step", worker_id=victim["worker_id"], role=victim["role"], pid=victim["pid"],
                       replaced_after_s=None if gone_s is None else round(gone_s, 2),
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        return "replaced" if gone_s is not None else f"not replaced in {HANG_WAIT_S:g} s (released)"

    async def step_error(self) -> str:
        victim = await self._busy(("prefill", "decode", "mixed"))
        if victim is None:
            return "skipped (no busy worker)"
        started = self.log.now()
        await self._call(victim["worker_id"], _actor_faults().raise_in_next_step)
        gone_s = await self._gone(victim["worker_id"], 60.0)
        self.log.event("step_error", worker_id=victim["worker_id"], role=victim["role"], pid=victim["pid"],
                       replaced_after_s=None if gone_s is None else round(gone_s, 2),
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        return f"{victim['role']}, {'replaced' if gone_s is not None else 'not replaced in 60 s'}"

    async def query_of_death(self) -> str:
        decoders = self._workers(("decode", "mixed"))
        if not decoders:
            return "skipped (no decode worker)"
        seed = QUERY_OF_DEATH_SEED_BASE + len(self.windows)
        started = self.log.now()
        for worker in decoders:
            await self._call(worker["worker_id"], _actor_faults().raise_in_steps_with_seed, seed)
        body = {"model": self.model, "prompt": [self.rng.randrange(100, 5000) for _ in range(24)],
                "max_tokens": 16, "temperature": 0, "seed": seed}
        try:
            answer = await self.client.post("/v1/completions", json=body, timeout=300)
            status, text = answer.status_code, answer.text[:300]
            code = (answer.json().get("error") or {}).get("code") if status != 200 else None
        except httpx.HTTPError as error:
            status, text, code = None, f"{type(error).__name__}", None
        for worker in decoders:  # those not replaced serve on without the fault
            with contextlib.suppress(Exception):  # replaced meanwhile: its replacement never had it
                await self._call(worker["worker_id"], _actor_faults().heal)
        ended = self.log.now()
        self.windows.append((started, ended, seed))
        self.log.event("query_of_death", worker_ids=[w["worker_id"] for w in decoders], seed=seed,
                       status=status, code=code, answer=text, start_s=round(started, 3),
                       end_s=round(ended, 3))
        if status is not None and status >= 400 and '"error"' not in text:
            self.log.violate("request_ends_clean",
                             f"the query of death got {status} without an OpenAI error: {text}")
        return f"answered {status} {code or ''}".strip()

    async def stall_pulls(self) -> str:
        """injectors.stall_new_pulls on every decode worker: only the pulls started in the next STALL_S stall
        (each ends by its own deadline), the others run as usual, and nothing needs healing: healing a
        receiver-wide injector while a stalled pull was in flight handed the backend a pull it never started
        and killed the worker (a harness artifact, seen in a run). Waits until every stalled pull is past its
        deadline before it reports."""
        decoders = self._workers(("decode", "mixed"))
        started = self.log.now()
        for worker in decoders:
            await self._call(worker["worker_id"], _injectors().stall_new_pulls, STALL_S)
        await asyncio.sleep(STALL_S + TRANSFER_TIMEOUT_S + 2.0)
        pools = await self.watch.fetch_pools()
        self.log.event("stall_pulls", worker_ids=[w["worker_id"] for w in decoders], stall_s=STALL_S,
                       start_s=round(started, 3), end_s=round(self.log.now(), 3),
                       workers_after=[{k: w.get(k) for k in ("worker_id", "role", "running_requests",
                                                             "waiting_requests", "used_kv_blocks")}
                                      for w in pools.get("workers", [])])
        return f"{len(decoders)} decode workers"

    async def lost_release(self) -> str:
        senders = self._workers(("prefill", "mixed"))
        if not senders:
            return "skipped (no prefill worker)"
        victim = self.rng.choice(senders)
        started = self.log.now()
        await self._call(victim["worker_id"], _actor_faults().lose_releases_and_shorten_leases)
        await asyncio.sleep(LEASE_FAULT_S)
        await self._call(victim["worker_id"], _actor_faults().heal)
        self.log.event("lost_release", worker_id=victim["worker_id"], role=victim["role"],
                       start_s=round(started, 3), end_s=round(self.log.now(), 3))
        return victim["role"]

    async def mismatched_peer(self) -> str:
        decoders = self._workers(("decode", "mixed"))
        answers = [await self._call(w["worker_id"], _injectors().add_mismatched_peer) for w in decoders]
        self.log.event("mismatched_peer", worker_ids=[w["worker_id"] for w in decoders], answers=answers)
        accepted = [w["worker_id"] for w, a in zip(decoders, answers, strict=True) if a == "accepted"]
        if accepted:
            self.log.violate("mismatched_peer_refused",
                             f"{accepted} accepted a sender with another KV layout")
        return "refused" if decoders and not accepted else ("skipped" if not decoders else "accepted")

    async def forged_claim(self) -> str:
        decoders = self._workers(("decode", "mixed"))
        sent = [await self._call(w["worker_id"], _injectors().forge_claims, 6) for w in decoders]
        self.log.event("forged_claim", worker_ids=[w["worker_id"] for w in decoders], claims=sum(sent))
        return f"{sum(sent)} claims" if sum(sent) else "skipped (no NIXL decode worker)"
