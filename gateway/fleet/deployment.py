"""The pools of worker actors and the wiring between them; sets the prefill:decode ratio.

This module starts the fleet, adds a worker, says its health and shuts it down; its parts, composed downward,
own the rest: reshape.py (change_role, drain_worker) and recovery.py (mark_failed, replacements, watch/loads)
above table.py (which workers there are and the target layout: create, bring-up, forget, changed), above
wiring.py (which worker pulls KV from which). No part holds the deployment, nor writes another's state.

Every worker is the same kind of actor (pool_worker.actor.WorkerActor) serving in a role: prefill, decode or
mixed. Lifecycle of a worker (WorkerState):
    create() (start(), add_worker(), a replacement) → PENDING (Ray places it on a node that offers its
    role's resources: gateway/fleet/placement.py)
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
Failures are noticed two ways: a frontend reports a worker whose call failed, which the fleet actor
confirms with its own probe before it calls mark_failed (gateway/control/fleet_actor.py), and watch() polls
every worker's load once a second: no answer, a dead step loop, or a step running far past the worker's own
(hung: step_watchdog_s) fail it. health() says ok / degraded / unavailable from the states.
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
import logging
import time

from gateway.fleet.adoption import adopt_survivors, adopted_degrees, layout_after_adoption
from gateway.fleet.bring_up_log import BringUpLog
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.placement import (
    PlacementTimeout,
    describe_unplaced,
    fit_no_live_node,
    torch_rendezvous,
    wait_all_placed,
    wait_placed,
)
from gateway.fleet.recovery import Recovery
from gateway.fleet.reshape import Reshape
from gateway.fleet.table import WorkerTable
from gateway.fleet.workers import PoolHealth, Worker, WorkerState, transition
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role
from worker_runtime.worker_setup import TorchGroupSpec

logger = logging.getLogger(__name__)

__all__ = ["PDDeployment"]


class PDDeployment:
    """The fleet as the rest of the gateway sees it: start-up, adding a worker, health and shutdown are its
    own; the fleet's state is its table's (self.table), role changes and drains its reshape's
    (self.reshape), failures, replacements and load polls its recovery's (self.recovery)."""

    def __init__(self, config: DeploymentConfig, keeper: str | None = None) -> None:
        """Args:
            keeper: the name of the fleet actor that runs this deployment, if one does (WorkerTable: its
                workers then outlive it, for its restart to adopt).
        """
        self.bring_up_log = BringUpLog()  # says each worker's placement and model load as they happen
        # Composed downward: recovery and reshape work on the table; the table knows neither.
        self.table = WorkerTable(config, keeper, self.bring_up_log)
        self.recovery = Recovery(self.table, config.step_watchdog_s)
        self.reshape = Reshape(self.table, self.table.wiring, self.recovery)
        self.torch_rendezvous: str | None = None  # the torch group's init address, once it is chosen
        # The names the rest of the gateway reaches the parts' state and operations by: the parts' own
        # objects and methods (one signature, one set of defaults), not copies of them.
        table = self.table
        self.workers, self.target, self.on_change = table.workers, table.target, table.on_change
        self.backend, self.can_change, self.wiring = table.backend, table.can_change, table.wiring
        self.on_remove = table.wiring.on_remove  # called with the id of a worker gone from its role
        self.active, self.retune = table.active, table.retune
        self.change_role, self.drain_worker = self.reshape.change_role, self.reshape.drain_worker
        self.mark_failed, self.is_replacing = self.recovery.mark_failed, self.recovery.is_replacing
        self.loads, self.watch = self.recovery.loads, self.recovery.watch

    @property
    def config(self) -> DeploymentConfig:
        """The settings new workers start under (retune replaces them)."""
        return self.table.config

    @property
    def block_size(self) -> int:
        return self.table.config.engine.block_size

    @property
    def last_loads(self) -> list[WorkerLoad]:
        """From the latest loads() (watch() refreshes it every second)."""
        return self.recovery.last_loads

    async def start(self) -> None:
        """Create every worker, wait for Ray to place them, start them and connect every decode or mixed
        worker to every worker it may pull KV from.

        Raises:
            PlacementTimeout: after placement_timeout_s, a fresh fleet's placed workers cannot serve (or
                a torch group lacks a rank); the message says what no node offers.
        """
        table = self.table
        adopted = await adopt_survivors(table, table.keeper) if table.keeper else []
        if adopted:
            table.set_target(layout_after_adoption(table.config.layout(), [w.role for w in adopted]))
            degrees = adopted_degrees([(w.role, w.tp) for w in adopted])
            if any(table.config.tp_of(role) != degree for role, degree in degrees.items()):
                table.retune({**table.config.role_tp, **degrees})
        missing = {role: table.target[role] - sum(w.role is role for w in adopted) for role in Role}
        roles = [role for role, count in missing.items() for _ in range(count)]
        workers = [table.create(role) for role in roles]
        with self.bring_up_log.start_up(workers):  # a line per worker event, so that start-up is not silent
            await self._bring_up_all(workers, adopted)

    async def _bring_up_all(self, workers: list[Worker], adopted: list[Worker]) -> None:
        """start()'s new `workers`, beside the `adopted` ones: placed, started, connected, ACTIVE."""
        config = self.table.config
        waited = await wait_all_placed(workers, config.placement_timeout_s, self.bring_up_log.placed,
                                       lambda: self._rest_fit_no_node(workers, adopted))
        placed = [w for w in workers if w.state is WorkerState.STARTING]
        unplaced = [w for w in workers if w.state is WorkerState.PENDING]
        fit_no_node = self._rest_fit_no_node(workers, adopted)
        if not self.can_change:
            if unplaced:  # a process group forms only when every rank has joined
                raise PlacementTimeout(describe_unplaced(unplaced, config, waited))
            await self._start_torch_group(workers)
            await self.wiring.connect(workers)
        else:
            # A fresh fleet that cannot decode does not start; a restarted one serves what lives on, its
            # lost workers pending (as the fleet before it did), rather than failing every start again
            # until a node comes back.
            if not adopted and not any(w.role.can_decode for w in placed):
                raise PlacementTimeout(describe_unplaced(unplaced, config, waited, fit_no_node))
            if unplaced:
                logger.warning("serving without %d worker(s) Ray has not placed yet: %s", len(unplaced),
                               describe_unplaced(unplaced, config, waited, fit_no_node))
            await asyncio.gather(*(self.table.start_worker(w) for w in placed))
            await self.wiring.connect([*adopted, *placed])
            self.recovery.start_late(unplaced)
        for worker in workers:
            if worker.state is WorkerState.STARTING:
                transition(worker, WorkerState.ACTIVE)
        self.table.changed()

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
        num_ranks = len(workers)
        await asyncio.gather(*(
            self.table.start_worker(w, TorchGroupSpec(self.torch_rendezvous, rank, num_ranks, group_backend))
            for rank, w in enumerate(workers)))

    async def add_worker(self, role: Role, wait_s: float | None = None) -> str:
        """Start one more worker in `role` and connect it; returns its id. It waits PENDING for a node up to
        `wait_s`, by default autoscale_wait_s where the cluster autoscales, else placement_timeout_s. If it
        does not come up (not placed in time: unplaceable; start() failed; cancelled), its actor is killed
        (its resource demand withdrawn), it is forgotten and the target is what it was."""
        table = self.table
        table.check_can_change()
        worker = table.create(Role(role))
        wait_s = wait_s or self.config.autoscale_wait_s or self.config.placement_timeout_s
        worker.placement_deadline = time.time() + wait_s
        table.move_target(None, role)
        try:
            try:
                await asyncio.wait_for(wait_placed(worker, self.bring_up_log.placed), wait_s)
            except TimeoutError:
                raise PlacementTimeout(describe_unplaced([worker], self.config, wait_s)) from None
            await table.bring_up(worker)
        except BaseException:
            table.move_target(role, None)
            table.forget(worker)
            table.changed()
            raise
        return worker.worker_id

    def health(self) -> PoolHealth:
        return PoolHealth.of(list(self.workers.values()), self.target, len(self.recovery.replacements))

    async def shutdown(self) -> None:
        self.table.close()
        for task in [*self.recovery.tasks(), *self.reshape.rewiring]:
            task.cancel()
        await self.table.stop_all()
