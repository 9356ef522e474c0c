"""(Over 300 lines: the membership of the pools and the one entry for every change to them; reshape,
recovery, wiring and placement are its parts, each in a file of its own.)

The pools of worker actors and the wiring between them; sets the prefill:decode ratio.

This module owns membership (start, add, bring-up, forget, shutdown); its parts own the rest:
reshape.py (change_role, drain_worker), recovery.py (mark_failed, replacements, watch/loads) and wiring.py
(which worker pulls KV from which).

Every worker is the same kind of actor (pool_worker.actor.WorkerActor) serving in a role: prefill, decode or
mixed. Lifecycle of a worker (WorkerState):
    add() → PENDING (created; Ray places it on a node that offers its role's resources:
    gateway/fleet/placement.py)
    → STARTING (placed, node known; start(): model found on its node and loaded, KV cache, transfer endpoint)
    → ACTIVE (routable; every decode or mixed worker knows the PeerInfo of every worker it may pull KV from:
      the prefill workers, and where the backend moves KV between decode workers (nixl) the other decode
      and mixed workers too)
    → change_role(): decode ⇄ mixed at once (same front, routed differently); to or from prefill the worker
      is CHANGING_ROLE: not routable, its decode streams evacuated to other workers (they continue from the
      tokens the client has, pulling the KV the evacuated worker offers them), and once it holds nothing
      (every such offer pulled or ended) its front is rebuilt in the new role over the same weights and KV
      cache; peers are rewired → ACTIVE in the new role
    → drain_worker(): DRAINING (not routable; finishes what it holds, or after a grace period evacuates it)
      → STOPPED (shutdown, actor killed, forgotten).
    Every operation that takes a worker out of ACTIVE puts it back on any exception or cancellation (state,
    next_role, target and peer wiring as they were), or, where the worker's own state is unknown (its
    set_role call failed or was cut off), marks it FAILED so that it is replaced; add_worker's bring-up
    that fails kills the new actor, forgets it and takes its target back. The states and their allowed
    moves: gateway/fleet/workers.py (TRANSITIONS).
    ACTIVE | DRAINING | CHANGING_ROLE → FAILED (its actor died, its step loop died, or it stopped
    answering): not routable; the actor is killed and a new worker of the same role is started in its place
    (retried with backoff until it comes up), so the pools return to their target size by themselves.
Failures are noticed two ways: the orchestrator reports a worker whose call failed (mark_failed), and
watch() polls every worker's load once a second: no answer, a dead step loop, or a step running far past
the worker's own (hung: step_watchdog_s) fail it. health() says ok / degraded / unavailable from the states.
A deployment kept by a fleet actor (keeper) starts by adopting the workers a predecessor of that actor left
running (gateway/fleet/adoption.py: Ray restarted it), and creates only what its layout still misses.
start() waits up to placement_timeout_s for Ray to place every worker (less where no live node can take the
rest: then there is nothing to wait for), then serves with those placed if they can serve; the others stay
PENDING and join when a node takes them. A worker on a node that dies is
FAILED like any other (Ray reports its actor dead); its replacement stays PENDING until capacity returns.
The torch transfer backend binds its peers up front (one process group, meeting on the first rank's node),
so its pools cannot grow, shrink, change roles or replace a worker after start, nor start with one missing;
nixl pools can.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import ray

from gateway.fleet.adoption import adopt_survivors, layout_after_adoption, settings_digest, worker_actor_name
from gateway.fleet.bring_up_log import BringUpLog
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.drain import DRAIN_GRACE_S, DRAIN_TIMEOUT_S, BooksOnTheWay
from gateway.fleet.placement import (
    PlacementTimeout,
    actor_options,
    describe_unplaced,
    fit_no_live_node,
    torch_rendezvous,
    wait_all_placed,
    wait_placed,
)
from gateway.fleet.rank_groups import rank_group
from gateway.fleet.recovery import Recovery
from gateway.fleet.reshape import Reshape
from gateway.fleet.wiring import PeerWiring
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import PoolHealth, Worker, WorkerState, can_transition, transition
from kv_transfer import capabilities
from pool_worker.api import worker_actor_class
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role
from worker_runtime.worker_setup import TorchGroupSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from pool_worker.actor import WorkerActor

logger = logging.getLogger(__name__)

__all__ = ["PDDeployment"]

SHUTDOWN_TIMEOUT_S = 30.0  # workers that have not closed their fronts by then are killed anyway


class PDDeployment:
    """Owns every worker actor of every role: which workers there are (membership); role changes and
    drains (self.reshape), failures and replacements (self.recovery) and peer wiring (self.wiring) are its
    parts'."""

    def __init__(self, config: DeploymentConfig, keeper: str | None = None) -> None:
        """Args:
            keeper: the name of the fleet actor that runs this deployment: its workers are then detached
                actors named under it, which outlive that actor's death and are adopted by its restart
                (gateway/fleet/adoption.py). None: they die with whoever created them.
        """
        self.config = config  # role_tp changes with a PUT that sets a role's degree (retune)
        # Names the settings this fleet started under, for its workers' actor names: a restarted fleet actor,
        # started under the same settings, adopts them whatever degree a PUT gave them since.
        self.digest = settings_digest(config)
        self.keeper = keeper
        self.backend = config.resolve_backend()
        self.workers: dict[str, Worker] = {}
        # Worker ids (and so Ray actor names) are unique in the cluster: several gateways may share one.
        self._tag = uuid.uuid4().hex[:6]
        self._ids = itertools.count()
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:12]}"  # names this gateway to every worker
        self.torch_rendezvous: str | None = None  # the torch group's init address, once it is chosen
        self.target: dict[Role, int] = config.layout()
        self.on_change: list[Callable[[], None]] = []  # called when the set of active workers changes
        self.is_closing = False
        self.wiring = PeerWiring(self.workers, self.backend)
        self.on_remove = self.wiring.on_remove  # called with the id of a worker gone from its role
        self.recovery = Recovery(self)
        self.reshape = Reshape(self)
        self.bring_up_log = BringUpLog()  # says each worker's placement and model load as they happen

    @property
    def block_size(self) -> int:
        return self.config.engine.block_size

    @property
    def can_change(self) -> bool:
        """Whether workers can be added, removed, replaced or change role (not with a fixed torch group)."""
        return not capabilities(self.backend).needs_peer_bound_up_front

    @property
    def last_loads(self) -> list[WorkerLoad]:
        """From the latest loads() (watch() refreshes it every second)."""
        return self.recovery.last_loads

    async def start(self) -> None:
        """Create every worker, wait for Ray to place them, start them and connect every decode or mixed
        worker to every worker it may pull KV from.

        Raises:
            PlacementTimeout: after placement_timeout_s, the placed workers cannot serve (or a torch
                group lacks a rank); the message says what no node offers.
        """
        adopted = await adopt_survivors(self, self.keeper) if self.keeper else []
        if adopted:
            self.target = layout_after_adoption(self.config.layout(), [w.role for w in adopted])
        missing = {role: self.target[role] - sum(w.role is role for w in adopted) for role in Role}
        roles = [role for role, count in missing.items() for _ in range(count)]
        workers = [self.create(role) for role in roles]
        with self.bring_up_log.start_up(workers):  # a line per worker event, so that start-up is not silent
            await self._bring_up_all(workers, adopted)

    async def _bring_up_all(self, workers: list[Worker], adopted: list[Worker]) -> None:
        """start()'s new `workers`, beside the `adopted` ones: placed, started, connected, ACTIVE."""
        waited = await wait_all_placed(workers, self.config.placement_timeout_s, self.bring_up_log.placed,
                                       lambda: self._rest_fit_no_node(workers, adopted))
        placed = [w for w in workers if w.state is WorkerState.STARTING]
        unplaced = [w for w in workers if w.state is WorkerState.PENDING]
        fit_no_node = self._rest_fit_no_node(workers, adopted)
        if not self.can_change:
            if unplaced:  # a process group forms only when every rank has joined
                raise PlacementTimeout(describe_unplaced(unplaced, self.config, waited))
            await self._start_torch_group(workers)
            await self.wiring.connect(workers)
        else:
            if not any(w.role.can_decode for w in [*adopted, *placed]):
                raise PlacementTimeout(describe_unplaced(unplaced, self.config, waited, fit_no_node))
            if unplaced:
                logger.warning("serving without %d worker(s) Ray has not placed yet: %s", len(unplaced),
                               describe_unplaced(unplaced, self.config, waited, fit_no_node))
            await asyncio.gather(*(self._start_worker(w) for w in placed))
            await self.wiring.connect([*adopted, *placed])
            self.recovery.late_starts = [
                asyncio.create_task(self.recovery.start_until_up(w.role, "start-up", w)) for w in unplaced]
        for worker in workers:
            if worker.state is WorkerState.STARTING:
                transition(worker, WorkerState.ACTIVE)
        self.changed()

    def _rest_fit_no_node(self, workers: list[Worker], adopted: list[Worker]) -> bool:
        """Start-up need not wait out placement_timeout_s for the workers not placed yet: no live node can
        take them beside the fleet's placed ones (they join when a node does). Not where the cluster
        autoscales (its autoscaler adds nodes for their demand), nor for a torch group (it needs them all)."""
        unplaced = [w for w in workers if w.state is WorkerState.PENDING]
        if not unplaced or self.config.autoscale_wait_s is not None or not self.can_change:
            return False
        placed = [*adopted, *(w for w in workers if w.state is not WorkerState.PENDING)]
        return fit_no_live_node(unplaced, placed, self.config)

    async def _start_torch_group(self, workers: list[Worker]) -> None:
        """Start every rank at once: each one's start() blocks until every rank has joined the group."""
        from kv_transfer.backends.torch_group import p2p_backend

        self.torch_rendezvous = await torch_rendezvous(workers[0])
        group_backend = p2p_backend(self.config.engine.device)  # NCCL for a CUDA KV cache, else gloo
        logger.info("torch group (%s) meets at %s", group_backend, self.torch_rendezvous)
        await asyncio.gather(*(
            self._start_worker(w, TorchGroupSpec(self.torch_rendezvous, rank, len(workers), group_backend))
            for rank, w in enumerate(workers)))

    async def _start_worker(self, worker: Worker, torch_group: TorchGroupSpec | None = None) -> None:
        worker.cpu_slot = self._free_cpu_slot(worker) if self.config.pin_cpus else None
        self.bring_up_log.loading(worker)
        try:
            info = await asyncio.wait_for(worker.client.start(torch_group, worker.cpu_slot),
                                          self.config.start_timeout_s)
        except Exception as error:
            self.bring_up_log.failed(worker, error)
            raise
        worker.runtime = info.runtime
        self.bring_up_log.loaded(worker)

    def _free_cpu_slot(self, worker: Worker) -> int:
        """The lowest slot no other live worker on the same node holds (a failed one's cores are free)."""
        taken = {w.cpu_slot for w in self.workers.values() if w is not worker and w.node_id == worker.node_id
                 and w.state is not WorkerState.FAILED}
        return next(slot for slot in itertools.count() if slot not in taken)

    def _worker_id(self, number: int) -> str:
        return f"worker-{self._tag}-{number}"

    def create(self, role: Role) -> Worker:
        """A new actor in `role`, PENDING until Ray places it (placement.wait_placed)."""
        worker_id = self._worker_id(next(self._ids))
        # With a keeper the worker outlives the fleet actor, for its restart to adopt.
        name = (worker_actor_name(self.keeper, self.digest, worker_id) if self.keeper
                else f"pdserve-{worker_id}")
        group = rank_group(self.config, role, name, detached=bool(self.keeper))
        options = actor_options(self.config, role, name, group)
        if self.keeper:
            options["lifetime"] = "detached"
        handle: ActorHandle[WorkerActor] = cast("ActorHandle[WorkerActor]",
            ray.remote(worker_actor_class())
            .options(**options)
            .remote(worker_id, role.value, self.config.engine_for(role), self.backend.value,
                    self.config.transfer,
                    watermark=self.config.watermark, num_threads=self.config.num_threads,
                    model_source=self.config.model_source, keeper=self.keeper))
        worker = Worker(worker_id, role, WorkerClient(worker_id, handle, self.gateway_id, name),
                        state=WorkerState.PENDING, tp=self.config.tp_of(role))
        self.workers[worker_id] = worker
        return worker

    def retune(self, role_tp: dict[Role, int]) -> None:
        """The tensor-parallel degrees of the workers started from now on, by role (Role.DECODE's is the
        mixed workers' too); the workers running keep theirs."""
        self.config = replace(self.config, role_tp=dict(role_tp))

    def active(self, *roles: Role) -> list[Worker]:
        """Routable workers in any of `roles`."""
        return [w for w in self.workers.values() if w.role in roles and w.state is WorkerState.ACTIVE]

    def check_can_change(self) -> None:
        if not self.can_change:
            raise RuntimeError(f"the {self.backend} transfer backend fixes its workers at start; use nixl to "
                               "change the pools")

    async def add_worker(self, role: Role, wait_s: float | None = None) -> str:
        """Start one more worker in `role` and connect it; returns its id. It waits PENDING for a node up to
        `wait_s`, by default autoscale_wait_s where the cluster autoscales, else placement_timeout_s. If it
        does not come up (not placed in time: unplaceable; start() failed; cancelled), its actor is killed
        (its resource demand withdrawn), it is forgotten and the target is what it was."""
        self.check_can_change()
        worker = self.create(Role(role))
        wait_s = wait_s or self.config.autoscale_wait_s or self.config.placement_timeout_s
        worker.placement_deadline = time.time() + wait_s
        self.target[role] += 1
        try:
            try:
                await asyncio.wait_for(wait_placed(worker, self.bring_up_log.placed), wait_s)
            except TimeoutError:
                raise PlacementTimeout(describe_unplaced([worker], self.config, wait_s)) from None
            await self.bring_up(worker)
        except BaseException:
            self.target[role] -= 1
            self.forget(worker)
            self.changed()
            raise
        return worker.worker_id

    async def bring_up(self, worker: Worker) -> None:
        """PENDING → placed (however long that takes) → started → connected → ACTIVE."""
        await wait_placed(worker, self.bring_up_log.placed)
        await self._start_worker(worker)
        await self.wiring.connect([worker])
        transition(worker, WorkerState.ACTIVE)
        self.changed()

    def forget(self, worker: Worker) -> None:
        """The worker leaves the deployment: its actor killed, its output stream closed, its peers told."""
        worker.client.kill()
        if can_transition(worker, WorkerState.STOPPED):
            transition(worker, WorkerState.STOPPED)
        self.workers.pop(worker.worker_id, None)
        self.wiring.unwire(worker)

    def changed(self) -> None:
        for callback in self.on_change:
            callback()

    def health(self) -> PoolHealth:
        return PoolHealth.of(list(self.workers.values()), self.target, len(self.recovery.replacements))

    # The operations its parts own, under the names callers use.

    async def change_role(self, worker_id: str, role: Role, books: BooksOnTheWay | None = None,
                          grace_s: float = 0.0, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Move an active worker to `role` without restarting it: Reshape.change_role."""
        await self.reshape.change_role(worker_id, role, books, grace_s, timeout_s)

    async def drain_worker(self, worker_id: str, books: BooksOnTheWay | None = None,
                           grace_s: float = DRAIN_GRACE_S, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop routing to a worker, wait until it holds nothing, then stop it: Reshape.drain_worker."""
        await self.reshape.drain_worker(worker_id, books, grace_s, timeout_s)

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Take a worker out of routing at once and start its replacement: Recovery.mark_failed."""
        self.recovery.mark_failed(worker_id, why)

    def is_replacing(self, *roles: Role) -> bool:
        """Whether a worker in any of `roles` is being started in place of a failed one."""
        return self.recovery.is_replacing(*roles)

    async def loads(self) -> list[WorkerLoad]:
        """Loads of the live workers; a dead or failing one is marked failed: Recovery.loads."""
        return await self.recovery.loads()

    async def watch(self, interval_s: float = 1.0) -> None:
        """Poll every worker's load forever: Recovery.watch."""
        await self.recovery.watch(interval_s)

    async def shutdown(self) -> None:
        self.is_closing = True
        for task in [*self.recovery.tasks(), *self.reshape.rewiring]:
            task.cancel()
        workers = list(self.workers.values())
        # A pending actor would answer only once placed, maybe never: it is just killed.
        started = [w for w in workers if w.state is not WorkerState.PENDING]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.client.shutdown() for w in started),
                                                  return_exceptions=True), SHUTDOWN_TIMEOUT_S)
        for worker in workers:
            worker.client.kill()
        self.workers.clear()
