"""The fleet's table: which workers there are, the layout they should reach, and the settings a new one starts
with. The deployment's parts (recovery.py, reshape.py, adoption.py) and the deployment itself read the fleet
here and change it only through the methods below; the table knows none of them.

    create() → a new worker actor, PENDING, in the table (add(): one that runs already, adopted)
    → bring_up(): placed (STARTING) → started (start_worker: model found and loaded, KV cache, endpoint)
      → connected to its peers (wiring.connect) → ACTIVE
    → forget(): out of the table: its actor killed, STOPPED, its peers told (wiring.unwire)
Each change to the set of active workers is announced by changed() to on_change's listeners. close() marks
the fleet as shutting down (nothing is replaced or started from then on); stop_all() then ends every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import ray

from gateway.fleet.placement import actor_options, wait_placed
from gateway.fleet.rank_groups import rank_group
from gateway.fleet.wiring import PeerWiring
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import Worker, WorkerState, can_transition, transition
from kv_transfer import capabilities
from pool_worker.api import worker_actor_class
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from gateway.fleet.bring_up_log import BringUpLog
    from gateway.fleet.config import DeploymentConfig
    from pool_worker.actor import WorkerActor
    from worker_runtime.worker_setup import TorchGroupSpec

SHUTDOWN_TIMEOUT_S = 30.0  # workers that have not closed their fronts by then are killed anyway


def settings_digest(config: DeploymentConfig) -> str:
    """Names the settings a worker was started under: only a fleet with the same ones adopts it."""
    return hashlib.sha256(repr(config).encode()).hexdigest()[:12]


def worker_actor_name(keeper: str, digest: str, worker_id: str) -> str:
    return f"{keeper}.{digest}.{worker_id}"


class WorkerTable:
    """Owns the fleet's shared state: its workers by id, the target count per role, the settings new workers
    start under, whether it is closing, the listeners told of a change, the peer wiring over the workers."""

    def __init__(self, config: DeploymentConfig, keeper: str | None, bring_up_log: BringUpLog) -> None:
        """Args:
            keeper: the name of the fleet actor that runs this fleet: its workers are then detached actors
                named under it, which outlive that actor's death and are adopted by its restart
                (gateway/fleet/adoption.py). None: they die with whoever created them.
            bring_up_log: says each worker's placement and model load as they happen.
        """
        self.config = config  # role_tp changes with a PUT that sets a role's degree (retune)
        # Names the settings this fleet started under, for its workers' actor names: a restarted fleet actor,
        # started under the same settings, adopts them whatever degree a PUT gave them since.
        self.digest = settings_digest(config)
        self.keeper = keeper
        self.backend = config.resolve_backend()
        self.workers: dict[str, Worker] = {}
        self.target: dict[Role, int] = config.layout()
        self.on_change: list[Callable[[], None]] = []  # called when the set of active workers changes
        self.is_closing = False
        self.wiring = PeerWiring(self.workers, self.backend)
        self.bring_up_log = bring_up_log
        # Worker ids (and so Ray actor names) are unique in the cluster: several gateways may share one.
        self._tag = uuid.uuid4().hex[:6]
        self._ids = itertools.count()
        self.gateway_id = f"gateway-{uuid.uuid4().hex[:12]}"  # names this gateway to every worker

    @property
    def can_change(self) -> bool:
        """Whether workers can be added, removed, replaced or change role (not with a fixed torch group)."""
        return not capabilities(self.backend).needs_peer_bound_up_front

    def check_can_change(self) -> None:
        if not self.can_change:
            raise RuntimeError(f"the {self.backend} transfer backend fixes its workers at start; use nixl to "
                               "change the pools")

    def active(self, *roles: Role) -> list[Worker]:
        """Routable workers in any of `roles`."""
        return [w for w in self.workers.values() if w.role in roles and w.state is WorkerState.ACTIVE]

    def retune(self, role_tp: dict[Role, int]) -> None:
        """The tensor-parallel degrees of the workers started from now on, by role (Role.DECODE's is the
        mixed workers' too); the workers running keep theirs."""
        self.config = replace(self.config, role_tp=dict(role_tp))

    def set_target(self, layout: dict[Role, int]) -> None:
        """The layout to reach (a restart's, from what it adopted); in place: readers hold this dict."""
        self.target.clear()
        self.target.update(layout)

    def move_target(self, old: Role | None, new: Role | None) -> None:
        """One worker fewer in `old`'s target and one more in `new`'s (None: a worker leaving or joining)."""
        if old is not None:
            self.target[old] -= 1
        if new is not None:
            self.target[new] += 1

    def create(self, role: Role) -> Worker:
        """A new actor in `role`, PENDING until Ray places it (placement.wait_placed)."""
        worker_id = f"worker-{self._tag}-{next(self._ids)}"
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
        self.add(worker)
        return worker

    def add(self, worker: Worker) -> None:
        """A worker joins the table as it is (created here, or adopted running)."""
        self.workers[worker.worker_id] = worker

    async def start_worker(self, worker: Worker, torch_group: TorchGroupSpec | None = None) -> None:
        """A placed worker finds and loads the model on its node, sizes its KV cache, opens its endpoint."""
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

    async def bring_up(self, worker: Worker) -> None:
        """PENDING → placed (however long that takes) → started → connected → ACTIVE."""
        await wait_placed(worker, self.bring_up_log.placed)
        await self.start_worker(worker)
        await self.wiring.connect([worker])
        transition(worker, WorkerState.ACTIVE)
        self.changed()

    def forget(self, worker: Worker) -> None:
        """The worker leaves the fleet: its actor killed, its output stream closed, its peers told."""
        worker.client.kill()
        if can_transition(worker, WorkerState.STOPPED):
            transition(worker, WorkerState.STOPPED)
        self.workers.pop(worker.worker_id, None)
        self.wiring.unwire(worker)

    def changed(self) -> None:
        for callback in self.on_change:
            callback()

    def close(self) -> None:
        """The fleet shuts down: no failed worker is replaced and no start is retried from now on."""
        self.is_closing = True

    async def stop_all(self) -> None:
        """Shut every worker down (bounded by SHUTDOWN_TIMEOUT_S), kill its actor, empty the table."""
        workers = list(self.workers.values())
        # A pending actor would answer only once placed, maybe never: it is just killed.
        started = [w for w in workers if w.state is not WorkerState.PENDING]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(w.client.shutdown() for w in started),
                                                  return_exceptions=True), SHUTDOWN_TIMEOUT_S)
        for worker in workers:
            worker.client.kill()
        self.workers.clear()
