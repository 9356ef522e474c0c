"""The pools of worker actors and the wiring between them; sets the prefill:decode ratio.

Every worker is the same kind of actor (pool_worker.actor.WorkerActor) serving in a role: prefill, decode or
mixed. Lifecycle of a worker (WorkerState):
    add() → PENDING (created; Ray places it on a node that offers its role's resources:
    gateway/fleet/placement.py)
    → STARTING (placed, node known; start(): model found on its node and loaded, KV cache, transfer endpoint)
    → ACTIVE (routable; every decode or mixed worker knows the PeerInfo of every worker it may pull KV from:
      the prefill workers, and with nixl the other decode and mixed workers too)
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
start() waits up to placement_timeout_s for Ray to place every worker, then serves with those placed if
they can serve; the others stay PENDING and join when a node takes them. A worker on a node that dies is
FAILED like any other (Ray reports its actor dead); its replacement stays PENDING until capacity returns.
The torch transfer backend binds its peers up front (one process group, meeting on the first rank's node),
so its pools cannot grow, shrink, change roles or replace a worker after start, nor start with one missing;
nixl pools can.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import ray

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.drain import check_grace, wait_until_empty
from gateway.fleet.placement import (
    PlacementTimeout,
    actor_options,
    describe_unplaced,
    torch_rendezvous,
    wait_all_placed,
    wait_placed,
)
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.worker_errors import StillBusy
from gateway.fleet.workers import PoolHealth, Worker, WorkerState, can_transition, transition
from kv_transfer import can_move_kv_between_decode_workers, capabilities
from pool_worker.actor import WorkerActor
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role
from worker_runtime.worker_setup import TorchGroupSpec

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

__all__ = ["DeploymentConfig", "PDDeployment"]


# A worker that does not answer a load query for this long is taken for dead (a dead actor fails at once).
LOAD_TIMEOUT_S = 30.0
SHUTDOWN_TIMEOUT_S = 30.0  # workers that have not closed their fronts by then are killed anyway
SET_ROLE_ATTEMPTS = 5  # a role change refused because work landed late is asked again this often
STEP_WATCHDOG_FACTOR = 10.0  # a step 10× the worker's longest finished one (and past the floor) is hung


class PDDeployment:
    """Owns every worker actor of every role."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.backend = config.resolve_backend()
        self.workers: dict[str, Worker] = {}
        # Worker ids (and so Ray actor names) are unique in the cluster: several gateways may share one.
        self._tag = uuid.uuid4().hex[:6]
        self._ids = itertools.count()
        self._wiring = itertools.count(1)  # orders add_peer against remove_peer on each worker
        self._gateway_id = f"gateway-{uuid.uuid4().hex[:12]}"  # names this gateway to every worker
        self._rewiring: set[asyncio.Task[None]] = set()  # role changes finishing in the background
        self.torch_rendezvous: str | None = None  # the torch group's init address, once it is chosen
        self.target: dict[Role, int] = config.layout()
        self.on_change: list[Callable[[], None]] = []  # called when the set of active workers changes
        self.on_remove: list[Callable[[str], None]] = []  # called with the id of a worker gone from its role
        # Failed worker id → (that worker, the task starting its replacement).
        self._replacements: dict[str, tuple[Worker, asyncio.Task[None]]] = {}
        self._late_starts: list[asyncio.Task[None]] = []  # workers still pending when start() went on
        self._is_closing = False
        self.last_loads: list[WorkerLoad] = []  # from the latest loads() (watch() refreshes it every second)

    @property
    def block_size(self) -> int:
        return self.config.engine.block_size

    @property
    def can_change(self) -> bool:
        """Whether workers can be added, removed, replaced or change role (not with a fixed torch group)."""
        return not capabilities(self.backend).needs_peer_bound_up_front

    async def start(self) -> None:
        """Create every worker, wait for Ray to place them, start them and connect every decode or mixed
        worker to every prefill worker.

        Raises:
            PlacementTimeout: after placement_timeout_s, the placed workers cannot serve (or a torch
                group lacks a rank); the message says what no node offers.
        """
        roles = [role for role, count in self.config.layout().items() for _ in range(count)]
        workers = [self._create(role) for role in roles]
        waited = await wait_all_placed(workers, self.config.placement_timeout_s)
        placed = [w for w in workers if w.state is WorkerState.STARTING]
        unplaced = [w for w in workers if w.state is WorkerState.PENDING]
        if not self.can_change:
            if unplaced:  # a process group forms only when every rank has joined
                raise PlacementTimeout(describe_unplaced(unplaced, self.config, waited))
            await self._start_torch_group(workers)
            await self._connect(workers)
        else:
            if not any(w.role.can_decode for w in placed):
                raise PlacementTimeout(describe_unplaced(unplaced, self.config, waited))
            if unplaced:
                logger.warning("serving without %d worker(s) Ray has not placed yet: %s", len(unplaced),
                               describe_unplaced(unplaced, self.config, waited))
            await asyncio.gather(*(self._start_worker(w) for w in placed))
            await self._connect(placed)
            self._late_starts = [asyncio.create_task(self._start_until_up(w.role, "start-up", w))
                                 for w in unplaced]
        for worker in workers:
            if worker.state is WorkerState.STARTING:
                transition(worker, WorkerState.ACTIVE)
        self._changed()

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
        info = await asyncio.wait_for(worker.client.start(torch_group, worker.cpu_slot),
                                      self.config.start_timeout_s)
        worker.runtime = info.runtime

    def _free_cpu_slot(self, worker: Worker) -> int:
        """The lowest slot no other live worker on the same node holds (a failed one's cores are free)."""
        taken = {w.cpu_slot for w in self.workers.values() if w is not worker and w.node_id == worker.node_id
                 and w.state is not WorkerState.FAILED}
        return next(slot for slot in itertools.count() if slot not in taken)

    def _worker_id(self, number: int) -> str:
        return f"worker-{self._tag}-{number}"

    def _create(self, role: Role) -> Worker:
        """A new actor in `role`, PENDING until Ray places it (placement.wait_placed)."""
        worker_id = self._worker_id(next(self._ids))
        options = actor_options(self.config, role, f"pdserve-{worker_id}")
        handle: ActorHandle[WorkerActor] = cast("ActorHandle[WorkerActor]",
            ray.remote(WorkerActor)
            .options(**options)
            .remote(worker_id, role.value, self.config.engine, self.backend.value, self.config.transfer,
                    watermark=self.config.watermark, num_threads=self.config.num_threads,
                    model_source=self.config.model_source))
        worker = Worker(worker_id, role, WorkerClient(worker_id, handle, self._gateway_id),
                        state=WorkerState.PENDING)
        self.workers[worker_id] = worker
        return worker

    async def _connect(self, new: list[Worker]) -> None:
        """Tell every decode or mixed worker about every worker it may pull KV from, where either is in
        `new`: every prefill worker, and (where the backend can move KV between decode workers, so that an
        evacuated stream's KV is pulled rather than recomputed) every other decode or mixed worker."""
        # A pending worker is not connected now: it connects itself once placed and started (_bring_up).
        alive = [w for w in self.workers.values() if w.state not in (WorkerState.FAILED, WorkerState.PENDING)]
        can_migrate = can_move_kv_between_decode_workers(self.backend)
        sources = [w for w in alive if w.role is Role.PREFILL or (can_migrate and w.role.can_decode)]
        decodes = [w for w in alive if w.role.can_decode]
        pairs = [(d, s) for d in decodes for s in sources if s is not d and (d in new or s in new)]
        needed = {s.worker_id: s for _, s in pairs}
        infos = await asyncio.gather(*(s.client.peer_info() for s in needed.values()))
        peers = dict(zip(needed, infos, strict=True))
        await asyncio.gather(*(d.client.add_peer(peers[s.worker_id], s.client, next(self._wiring))
                               for d, s in pairs))

    def active(self, *roles: Role) -> list[Worker]:
        """Routable workers in any of `roles`."""
        return [w for w in self.workers.values() if w.role in roles and w.state is WorkerState.ACTIVE]

    def _check_can_change(self) -> None:
        if not self.can_change:
            raise RuntimeError(f"the {self.backend} transfer backend fixes its workers at start; use nixl to "
                               "change the pools")

    async def add_worker(self, role: Role) -> str:
        """Start one more worker in `role` and connect it; returns its id. It waits PENDING for a node up to
        autoscale_wait_s where the cluster autoscales, else placement_timeout_s. If it does not come up (not
        placed in time: unplaceable; start() failed; cancelled), its actor is killed (its resource demand
        withdrawn), it is forgotten and the target is what it was."""
        self._check_can_change()
        worker = self._create(Role(role))
        wait_s = self.config.autoscale_wait_s or self.config.placement_timeout_s
        worker.placement_deadline = time.time() + wait_s
        self.target[role] += 1
        try:
            try:
                await asyncio.wait_for(wait_placed(worker), wait_s)
            except TimeoutError:
                raise PlacementTimeout(describe_unplaced([worker], self.config, wait_s)) from None
            await self._bring_up(worker)
        except BaseException:
            self.target[role] -= 1
            self._forget(worker)
            self._changed()
            raise
        return worker.worker_id

    async def change_role(self, worker_id: str, role: Role, in_flight: Callable[[str], int] | None = None,
                          grace_s: float = 0.0, timeout_s: float = 300.0) -> None:
        """Move an active worker to `role` without restarting it (see the lifecycle).

        Args:
            in_flight: the gateway's count of what it has sent the worker and not seen come back.
            grace_s: how long its decode streams may run on before they are evacuated to other workers.
        """
        self._check_can_change()
        check_grace(grace_s, timeout_s)
        worker, role = self.workers[worker_id], Role(role)
        old = worker.role
        if not worker.is_active:
            raise RuntimeError(f"{worker_id} is {worker.state.value}, not active")
        if role is old:
            return
        self._check_others_can_decode(worker, role)
        if old.can_decode and role.can_decode:  # decode ⇄ mixed: only the routing changes
            await worker.client.set_role(role)
            worker.role = role
            self._move_target(old, role)
            self._changed()
            return
        transition(worker, WorkerState.CHANGING_ROLE)
        worker.next_role = role
        self._move_target(old, role)
        self._changed()
        is_unwired = is_sent = False
        try:
            await wait_until_empty(worker, in_flight, grace_s, timeout_s)
            self._unwire(worker)  # its endpoint closes with its old front
            is_unwired = is_sent = True
            for attempt in range(1, SET_ROLE_ATTEMPTS + 1):
                try:
                    await worker.client.set_role(role)
                    break
                except StillBusy:
                    # A submission in flight landed after the books read empty (several frontends report
                    # every 0.5 s): the worker changed nothing; drained again (no more grace), it is asked
                    # again, rather than taken for broken.
                    if attempt == SET_ROLE_ATTEMPTS:
                        raise
                    await wait_until_empty(worker, in_flight, 0.0, timeout_s)
        except BaseException as error:
            if worker.state is not WorkerState.CHANGING_ROLE:  # it failed meanwhile: being replaced
                raise
            if is_sent:  # the actor may be in either role, or without a front: replace it
                self.mark_failed(worker_id, f"its change to {role.value} failed: {type(error).__name__}")
            else:
                logger.warning("%s: the change to %s stopped (%s); it stays %s", worker_id, role.value,
                               type(error).__name__, old.value)
                self._move_target(role, old)
                worker.next_role = old if is_unwired else None
                self._finish_role_change(worker, is_unwired)
            raise
        worker.role = role
        try:
            await self._connect([worker])
        except BaseException as error:
            if isinstance(error, Exception):
                self.mark_failed(worker_id, f"its peers could not be told of it: {type(error).__name__}")
            else:  # cancelled: the wiring finishes in the background
                self._finish_role_change(worker, is_unwired=True)
            raise
        self._finish_role_change(worker, is_unwired=False)

    def _move_target(self, old: Role, new: Role) -> None:
        self.target[old] -= 1
        self.target[new] += 1

    def _finish_role_change(self, worker: Worker, is_unwired: bool) -> None:
        """ACTIVE in worker.role: at once if its peers know its endpoint, else once they are told it (in the
        background: the change was cancelled or stopped; a worker that cannot be wired is FAILED).
        next_role stays set until then: requests waiting for a worker in that role wait for it."""
        if worker.state is not WorkerState.CHANGING_ROLE:  # it failed meanwhile: being replaced
            return
        if not is_unwired:
            transition(worker, WorkerState.ACTIVE)
            worker.next_role = None
            self._changed()
            return

        async def rewire() -> None:
            try:
                await self._connect([worker])
            except Exception as error:
                why = f"its peers could not be told of it: {type(error).__name__}"
                self.mark_failed(worker.worker_id, why)
                return
            if worker.state is WorkerState.CHANGING_ROLE:
                transition(worker, WorkerState.ACTIVE)
                worker.next_role = None
                self._changed()

        task = asyncio.get_running_loop().create_task(rewire(), context=contextvars.Context())
        self._rewiring.add(task)
        task.add_done_callback(self._rewiring.discard)
        self._changed()

    def _check_others_can_decode(self, leaving: Worker, new_role: Role | None = None) -> None:
        others = [w for w in self.workers.values() if w.is_active and w is not leaving]
        if leaving.is_active and not (new_role and new_role.can_decode) and not any(
                w.role.can_decode for w in others):
            raise ValueError(f"{leaving.worker_id} is the last active worker that can decode")

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Take a worker out of routing at once and start its replacement (idempotent)."""
        worker = self.workers.get(worker_id)
        # PENDING and STARTING workers are their bring-up's to clean up; FAILED and STOPPED ones are done.
        if worker is None or worker.state in (WorkerState.FAILED, WorkerState.PENDING, WorkerState.STARTING,
                                              WorkerState.STOPPED):
            return
        logger.error("worker %s failed: %s", worker_id, why)
        was_draining = worker.state is WorkerState.DRAINING
        transition(worker, WorkerState.FAILED)
        self._changed()
        if self._is_closing:
            return
        if not self.can_change:
            logger.error("the %s transfer backend fixes its workers at start: %s is not replaced",
                         self.backend, worker_id)
            return
        if was_draining:  # it was leaving anyway: remove it, start nothing
            self._forget(worker)
            return
        # Not the request's that noticed the failure (its log lines' request id): an empty context.
        replacing = asyncio.create_task(self._replace(worker), context=contextvars.Context())
        self._replacements[worker_id] = (worker, replacing)

    def is_replacing(self, *roles: Role) -> bool:
        """Whether a worker in any of `roles` is being started in place of a failed one."""
        return any((w.next_role or w.role) in roles for w, _ in self._replacements.values())

    async def _replace(self, failed: Worker) -> None:
        self._forget(failed)
        role = failed.next_role or failed.role  # a worker that failed while changing role: its new role
        await self._start_until_up(role, failed.worker_id)
        self._replacements.pop(failed.worker_id, None)

    async def _start_until_up(self, role: Role, instead_of: str, worker: Worker | None = None,
                              first_retry_s: float = 1.0) -> None:
        """Bring a worker in `role` up, retrying with backoff until one is; it may stay PENDING for as long
        as no node can take it (a lost node's replacement waits for capacity to return)."""
        retry_s = first_retry_s
        while not self._is_closing:
            worker = worker or self._create(role)
            try:
                await self._bring_up(worker)
            except BaseException as error:
                if not isinstance(error, Exception):  # cancelled (shutdown): nothing half started stays
                    self._forget(worker)
                    raise
                logger.error("worker %s (for %s) did not start (%s: %s); retrying in %.0f s",
                             worker.worker_id, instead_of, type(error).__name__, error, retry_s)
                self._forget(worker)
                worker = None
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, 30.0)
                continue
            logger.warning("worker %s is up (for %s) on %s", worker.worker_id, instead_of, worker.node_ip)
            break

    async def _bring_up(self, worker: Worker) -> None:
        """PENDING → placed (however long that takes) → started → connected → ACTIVE."""
        await wait_placed(worker)
        await self._start_worker(worker)
        await self._connect([worker])
        transition(worker, WorkerState.ACTIVE)
        self._changed()

    def _forget(self, worker: Worker) -> None:
        """The worker leaves the deployment: its actor killed, its output stream closed, its peers told."""
        worker.client.kill()
        if can_transition(worker, WorkerState.STOPPED):
            transition(worker, WorkerState.STOPPED)
        self.workers.pop(worker.worker_id, None)
        self._unwire(worker)

    def _unwire(self, worker: Worker) -> None:
        """The worker's endpoint goes away (it leaves, or its role changes to or from prefill): the router
        and every decode or mixed worker forget it."""
        for callback in self.on_remove:
            callback(worker.worker_id)
        for decode in self.workers.values():
            if decode is not worker and decode.role.can_decode and decode.state is not WorkerState.FAILED:
                decode.client.remove_peer(worker.worker_id, next(self._wiring))

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()

    def health(self) -> PoolHealth:
        return PoolHealth.of(list(self.workers.values()), self.target, len(self._replacements))

    async def watch(self, interval_s: float = 1.0) -> None:
        """Poll every worker's load forever, so that a worker that died while idle is noticed and replaced."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.loads()
            except Exception:  # the watcher itself must never die
                logger.exception("pool watch failed")

    async def drain_worker(self, worker_id: str, in_flight: Callable[[str], int] | None = None,
                           grace_s: float = 30.0, timeout_s: float = 300.0) -> None:
        """Stop routing to a worker, wait until it holds nothing, then stop it.

        Args:
            in_flight: the gateway's count of what it has sent the worker and not seen come back; a call
                on its way is not in the worker's load yet, so the drain also waits for this to be 0.
            grace_s: how long its decode streams may run on before they are evacuated to other workers.
        """
        self._check_can_change()
        check_grace(grace_s, timeout_s)
        worker = self.workers[worker_id]
        self._check_others_can_decode(worker)
        transition(worker, WorkerState.DRAINING)
        self.target[worker.role] -= 1
        self._changed()
        try:
            await wait_until_empty(worker, in_flight, grace_s, timeout_s)
        except BaseException as error:
            if worker.state is WorkerState.DRAINING:  # not failed meanwhile: it serves on
                logger.warning("%s: the drain stopped (%s); it stays", worker_id, type(error).__name__)
                transition(worker, WorkerState.ACTIVE)
                self.target[worker.role] += 1
                self._changed()
            raise
        try:
            await worker.client.shutdown()
        finally:  # it holds nothing: whatever the shutdown call did, it goes
            self._forget(worker)

    async def loads(self) -> list[WorkerLoad]:
        """Loads of the live workers; a worker that is dead or reports a failure is marked failed."""
        live = (WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.CHANGING_ROLE)
        workers = [w for w in self.workers.values() if w.state in live]
        answers = await asyncio.gather(
            *(asyncio.wait_for(w.client.load(), LOAD_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        loads = []
        for worker, answer in zip(workers, answers, strict=True):
            if isinstance(answer, BaseException):
                self.mark_failed(worker.worker_id, f"no load report: {type(answer).__name__}")
            elif answer.failure:
                self.mark_failed(worker.worker_id, answer.failure)
            elif hung := self._hung(answer):
                self.mark_failed(worker.worker_id, hung)
            else:
                loads.append(answer)
        self.last_loads = loads
        return loads

    def _hung(self, load: WorkerLoad) -> str:
        """Why the worker's running step counts as hung (empty: it does not): it has run past both the
        configured floor and STEP_WATCHDOG_FACTOR times the longest step the worker has finished, so a
        worker whose steps are slow by nature (long prefill chunks on a CPU) is judged by its own."""
        floor = self.config.step_watchdog_s
        if not floor:
            return ""
        bound = max(floor, STEP_WATCHDOG_FACTOR * load.longest_step_s)
        if load.step_running_s <= bound:
            return ""
        return (f"hung: its step has run {load.step_running_s:.0f} s (its longest finished step "
                f"{load.longest_step_s:.1f} s; bound {bound:.0f} s)")

    async def shutdown(self) -> None:
        self._is_closing = True
        for task in [*(task for _, task in self._replacements.values()), *self._late_starts, *self._rewiring]:
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
