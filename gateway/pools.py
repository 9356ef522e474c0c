"""The two pools of Ray actors and the wiring between them; sets the prefill:decode ratio.

Lifecycle of a worker (WorkerState):  add() → STARTING (actor constructor: model load, KV cache, agent)
    → ACTIVE (routable; every decode worker knows every prefill worker's PeerInfo)
    → DRAINING (not routable; finishes what it holds) → removed (shutdown, actor killed).
    ACTIVE | DRAINING → FAILED (its actor died, its step loop died, or it stopped answering): not routable;
    the actor is killed and a new worker of the same kind is started in its place (retried with backoff
    until it comes up), so the pools return to their target size by themselves.
Failures are noticed two ways: the orchestrator reports a worker whose call failed (mark_failed), and
watch() polls every worker's load once a second. health() says ok / degraded / unavailable from the states.
The torch transfer backend binds its peers up front (one process group), so its pools cannot grow, shrink
or replace a worker after start; nixl pools can.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from decode_pool.actor import DecodeActor
from gateway.workers import PoolHealth, Worker, WorkerState
from kv_transfer import BackendName, TransferConfig, capabilities
from kv_transfer.registry import resolve
from llm_engine import EngineConfig
from llm_engine.load import WorkerLoad
from llm_engine.worker_setup import TorchGroupSpec
from prefill_pool.actor import PrefillActor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeploymentConfig:
    """What `pdserve serve` starts."""

    engine: EngineConfig  # model, dtype, device, block size, KV budget (the same for both roles)
    num_prefill: int = 1
    num_decode: int = 1
    # Colocated baseline: this many workers that each prefill and decode (no KV transfer); when set,
    # num_prefill and num_decode must be 0.
    num_colocated: int = 0
    backend: str = "auto"  # "nixl", "torch" or "auto" (nixl if it imports, else torch)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    watermark: float = 0.05  # fraction of decode blocks kept free when admitting
    num_cpus_per_worker: float = 1.0  # Ray resource request of each actor
    num_gpus_per_worker: float = 0.0
    num_threads: int = 1  # torch threads per worker
    start_timeout_s: float = 300.0  # a worker that has not loaded its model by then is given up and retried

    def __post_init__(self) -> None:
        if self.num_colocated:
            if self.num_colocated < 0 or self.num_prefill or self.num_decode:
                raise ValueError("colocated mode takes num_colocated >= 1 and no prefill or decode workers")
        elif self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError(
                f"need at least 1 prefill and 1 decode worker, got {self.num_prefill}:{self.num_decode}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def resolve_backend(self) -> BackendName:
        if self.num_colocated:
            return BackendName.LOCAL  # nothing crosses processes: each worker prefills for itself
        if self.backend != "auto":
            return resolve(self.backend).name  # unknown names raise, listing the known ones
        if resolve(BackendName.NIXL).is_available():
            logger.info("KV transfer backend nixl: it imports here (one-sided READ over UCX)")
            return BackendName.NIXL
        logger.info("KV transfer backend torch: nixl does not import here")
        return BackendName.TORCH


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A worker that does not answer a load query for this long is taken for dead (a dead actor fails at once).
LOAD_TIMEOUT_S = 30.0


class PDDeployment:
    """Owns every worker actor of both roles."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.backend = config.resolve_backend()
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()
        self._torch_groups: dict[str, TorchGroupSpec] = {}
        self.target = {"prefill": config.num_prefill, "decode": config.num_decode,
                       "colocated": config.num_colocated}
        self.on_change: list[Callable[[], None]] = []  # called when the set of active workers changes
        self.on_remove: list[Callable[[str], None]] = []  # called with the id of a worker that is gone
        # Failed worker id → (that worker, the task starting its replacement).
        self._replacements: dict[str, tuple[Worker, asyncio.Task[None]]] = {}
        self._is_closing = False

    async def start(self) -> None:
        """Create both pools and connect every decode worker to every prefill worker."""
        if capabilities(self.backend).needs_peer_bound_up_front:
            from kv_transfer.backends.torch_dist import p2p_backend

            world = self.config.num_prefill + self.config.num_decode
            init = f"tcp://127.0.0.1:{_free_port()}"
            group_backend = p2p_backend(self.config.engine.device)  # NCCL for a CUDA KV cache, else gloo
            for rank in range(world):
                role = "prefill" if rank < self.config.num_prefill else "decode"
                self._torch_groups[f"{role}-{rank}"] = TorchGroupSpec(init, rank, world, group_backend)
        names = [f"prefill-{i}" for i in range(self.config.num_prefill)]
        names += [f"decode-{self.config.num_prefill + i}" for i in range(self.config.num_decode)]
        names += [f"colocated-{i}" for i in range(self.config.num_colocated)]
        self._ids = itertools.count(len(names))
        for name in names:
            self._create(name)
        # Constructors run concurrently (a torch group forms only when every rank has joined).
        await asyncio.gather(*(w.actor.load.remote() for w in self.workers.values()))
        await self._connect(list(self.workers.values()))
        for worker in self.workers.values():
            worker.state = WorkerState.ACTIVE
        self._changed()

    def _create(self, worker_id: str) -> Worker:
        role = worker_id.split("-")[0]
        # A colocated worker is a decode worker that receives no handles and so prefills for itself.
        cls = PrefillActor if role == "prefill" else DecodeActor
        options = {
            "num_cpus": self.config.num_cpus_per_worker,
            "num_gpus": self.config.num_gpus_per_worker,
            "name": f"pdserve-{worker_id}",
            "max_concurrency": 1000,
        }
        kwargs: dict[str, Any] = {
            "num_threads": self.config.num_threads,
            "torch_group": self._torch_groups.get(worker_id),
        }
        if role != "prefill":
            kwargs["watermark"] = self.config.watermark
        actor = (
            ray.remote(cls)
            .options(**options)
            .remote(worker_id, self.config.engine, self.backend.value, self.config.transfer, **kwargs)
        )
        worker = Worker(
            worker_id, "decode" if role == "colocated" else role, actor, is_colocated=role == "colocated"
        )
        self.workers[worker_id] = worker
        return worker

    async def _connect(self, new: list[Worker]) -> None:
        alive = [w for w in self.workers.values() if w.state is not WorkerState.FAILED]
        prefills = [w for w in alive if w.role == "prefill"]
        decodes = [w for w in alive if w.role == "decode"]
        peers = dict(
            zip(
                [p.worker_id for p in prefills],
                await asyncio.gather(*(p.actor.peer_info.remote() for p in prefills)),
                strict=True,
            )
        )
        calls = [
            d.actor.add_prefill_peer.remote(peers[p.worker_id], p.actor)
            for d in decodes
            for p in prefills
            if d in new or p in new
        ]
        await asyncio.gather(*calls)

    def active(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.state is WorkerState.ACTIVE]

    async def add_worker(self, role: str) -> str:
        """Start one more worker of `role` and connect it; returns its id."""
        if capabilities(self.backend).needs_peer_bound_up_front:
            raise RuntimeError(
                f"the {self.backend} transfer backend fixes its workers at start; use nixl to resize pools"
            )
        worker = self._create(f"{role}-{next(self._ids)}")
        self.target[worker.kind] += 1
        await worker.actor.load.remote()
        await self._connect([worker])
        worker.state = WorkerState.ACTIVE
        self._changed()
        return worker.worker_id

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Take a worker out of routing at once and start its replacement (idempotent)."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.state in (WorkerState.FAILED, WorkerState.STARTING):
            return
        logger.error("worker %s failed: %s", worker_id, why)
        was_draining = worker.state is WorkerState.DRAINING
        worker.state = WorkerState.FAILED
        self._changed()
        if self._is_closing:
            return
        if capabilities(self.backend).needs_peer_bound_up_front:
            logger.error("the %s transfer backend fixes its workers at start: %s is not replaced",
                         self.backend, worker_id)
            return
        if was_draining:  # it was leaving anyway: remove it, start nothing
            self._forget(worker)
            return
        self._replacements[worker_id] = (worker, asyncio.create_task(self._replace(worker)))

    def is_replacing(self, role: str) -> bool:
        """Whether a worker that can serve `role` is being started in place of a failed one."""
        return any(w.role == role for w, _ in self._replacements.values())

    async def _replace(self, failed: Worker, first_retry_s: float = 1.0) -> None:
        self._forget(failed)
        retry_s = first_retry_s
        while not self._is_closing:
            worker = self._create(f"{failed.kind}-{next(self._ids)}")
            try:
                await asyncio.wait_for(worker.actor.load.remote(), self.config.start_timeout_s)
                await self._connect([worker])
            except Exception as error:
                logger.error("replacement %s for %s did not start (%s); retrying in %.0f s",
                             worker.worker_id, failed.worker_id, type(error).__name__, retry_s)
                self._forget(worker)
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, 30.0)
                continue
            worker.state = WorkerState.ACTIVE
            logger.warning("worker %s replaces the failed %s", worker.worker_id, failed.worker_id)
            self._changed()
            break
        self._replacements.pop(failed.worker_id, None)

    def _forget(self, worker: Worker) -> None:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(worker.actor, no_restart=True)
        self.workers.pop(worker.worker_id, None)
        for callback in self.on_remove:
            callback(worker.worker_id)
        if worker.role == "prefill":  # decode workers forget it as a peer
            for decode in self.active("decode"):
                decode.actor.remove_prefill_peer.remote(worker.worker_id)

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

    async def drain_worker(self, worker_id: str, poll_s: float = 0.05, timeout_s: float = 300.0,
                           in_flight: Callable[[str], int] | None = None) -> None:
        """Stop routing to a worker, wait until it holds nothing, then stop it.

        Args:
            in_flight: the gateway's count of what it has sent the worker and not seen come back; a call
                on its way is not in the worker's load yet, so the drain also waits for this to be 0.
        """
        worker = self.workers[worker_id]
        others = [w for w in self.workers.values() if w.is_active and w is not worker]
        lacking = [role for role, can in (
            ("prefill", any(w.role == "prefill" or w.is_colocated for w in others)),
            ("decode", any(w.role == "decode" for w in others))) if not can]
        if worker.is_active and lacking:
            raise ValueError(f"{worker_id} is the last active worker that can {' or '.join(lacking)}")
        worker.state = WorkerState.DRAINING
        self.target[worker.kind] -= 1
        self._changed()
        deadline = asyncio.get_running_loop().time() + timeout_s
        num_idle = 0
        while num_idle < 2:  # twice in a row: a request between the two reads shows in one of them
            load = await worker.actor.load.remote()
            is_idle = load.num_requests == 0 and load.num_free_blocks == load.num_total_blocks
            num_idle = num_idle + 1 if is_idle and not (in_flight and in_flight(worker_id)) else 0
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(
                    f"{worker_id} still holds {load.num_requests} requests after {timeout_s:.0f} s"
                )
            await asyncio.sleep(poll_s)
        await worker.actor.shutdown.remote()
        self._forget(worker)

    async def loads(self) -> list[WorkerLoad]:
        """Loads of the live workers; a worker that is dead or reports a failure is marked failed."""
        workers = [w for w in self.workers.values() if w.state in (WorkerState.ACTIVE, WorkerState.DRAINING)]
        answers = await asyncio.gather(
            *(asyncio.wait_for(w.actor.load.remote(), LOAD_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        loads = []
        for worker, answer in zip(workers, answers, strict=True):
            if isinstance(answer, BaseException):
                self.mark_failed(worker.worker_id, f"no load report: {type(answer).__name__}")
            elif answer.failure:
                self.mark_failed(worker.worker_id, answer.failure)
            else:
                loads.append(answer)
        return loads

    async def shutdown(self) -> None:
        self._is_closing = True
        for _, task in self._replacements.values():
            task.cancel()
        workers = list(self.workers.values())
        await asyncio.gather(*(w.actor.shutdown.remote() for w in workers), return_exceptions=True)
        for worker in workers:
            ray.kill(worker.actor)
        self.workers.clear()
