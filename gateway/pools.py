"""The two pools of Ray actors and the wiring between them; sets the prefill:decode ratio.

Lifecycle of a worker:  add() → STARTING (actor constructor: model load, KV cache, transfer agent)
    → ACTIVE (routable; every decode worker knows every prefill worker's PeerInfo)
    → DRAINING (not routable; finishes what it holds) → STOPPED (shutdown, actor killed).
The torch transfer backend binds its peers up front (one process group), so its pools cannot grow or
shrink after start; nixl pools can.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import ray

from decode_pool.actor import DecodeActor
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


@dataclass
class Worker:
    worker_id: str
    role: str  # "prefill" or "decode"
    actor: Any  # Ray actor handle
    is_draining: bool = False
    is_colocated: bool = False  # prefills its own requests (role is then "decode")


class PDDeployment:
    """Owns every worker actor of both roles."""

    def __init__(self, config: DeploymentConfig) -> None:
        self.config = config
        self.backend = config.resolve_backend()
        self.workers: dict[str, Worker] = {}
        self._ids = itertools.count()
        self._torch_groups: dict[str, TorchGroupSpec] = {}

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
        prefills = [w for w in self.workers.values() if w.role == "prefill"]
        decodes = [w for w in self.workers.values() if w.role == "decode"]
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
        return [w for w in self.workers.values() if w.role == role and not w.is_draining]

    async def add_worker(self, role: str) -> str:
        """Start one more worker of `role` and connect it; returns its id."""
        if capabilities(self.backend).needs_peer_bound_up_front:
            raise RuntimeError(
                f"the {self.backend} transfer backend fixes its workers at start; use nixl to resize pools"
            )
        worker = self._create(f"{role}-{next(self._ids)}")
        await worker.actor.load.remote()
        await self._connect([worker])
        return worker.worker_id

    async def drain_worker(self, worker_id: str, poll_s: float = 0.05, timeout_s: float = 300.0) -> None:
        """Stop routing to a worker, wait until it holds nothing, then stop it."""
        worker = self.workers[worker_id]
        if len(self.active(worker.role)) <= 1 and not worker.is_draining:
            raise ValueError(f"{worker_id} is the last active {worker.role} worker")
        worker.is_draining = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await worker.actor.is_whole.remote():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{worker_id} still holds KV blocks after {timeout_s} s")
            await asyncio.sleep(poll_s)
        await worker.actor.shutdown.remote()
        ray.kill(worker.actor)
        del self.workers[worker_id]

    async def loads(self) -> list[WorkerLoad]:
        workers = list(self.workers.values())
        return list(await asyncio.gather(*(w.actor.load.remote() for w in workers)))

    async def shutdown(self) -> None:
        workers = list(self.workers.values())
        await asyncio.gather(*(w.actor.shutdown.remote() for w in workers), return_exceptions=True)
        for worker in workers:
            ray.kill(worker.actor)
        self.workers.clear()
