"""What `pdserve serve` starts: the layout of the pools and every worker's settings."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kv_transfer import BackendName, TransferConfig
from kv_transfer.registry import resolve
from llm_engine.config import EngineConfig
from llm_engine.model_files import read_model_spec
from llm_engine.rank_shares import check_tensor_parallel
from worker_runtime.model_source import ModelSource
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)

CANNOT_SERVE = ("cannot serve: it needs at least one worker that can prefill (prefill or mixed) and one that "
                "can decode (decode or mixed)")


def can_serve(layout: Mapping[Role, int]) -> bool:
    """Whether a layout one asks for (at start, or PUT /admin/pools) can serve: some worker prefills and some
    decodes. A decode worker prefills its own requests only as a fallback (Role.can_prefill), while a
    prefill pool is being replaced or drained; a layout may not rely on it. (A running fleet asks less:
    PoolHealth and start-up need only a worker that can decode.)"""
    num_can_prefill = sum(n for role, n in layout.items() if role.can_prefill)
    num_can_decode = sum(n for role, n in layout.items() if role.can_decode)
    return num_can_prefill >= 1 and num_can_decode >= 1


@dataclass(frozen=True)
class DeploymentConfig:
    engine: EngineConfig  # model, dtype, device, block size, KV budget (the same for every role)
    num_prefill: int = 1
    num_decode: int = 1
    num_mixed: int = 0  # workers that prefill and decode their own requests (the colocated layout)
    backend: str = "auto"  # "nixl", "torch", "local" or "auto" (nixl if it imports, else torch)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    watermark: float = 0.05  # fraction of decode blocks kept free when admitting
    num_cpus_per_worker: float = 1.0  # Ray resource request of each actor
    num_gpus_per_worker: float = 0.0  # fractions share a GPU between workers
    # Ray custom resources each role's workers ask for, e.g. {Role.DECODE: {"pdserve_decode": 1}}: only
    # nodes started with those resources take that role (gateway/fleet/placement.py).
    role_resources: dict[Role, dict[str, float]] = field(default_factory=dict)
    # Tensor-parallel ranks of each role's workers where it differs from engine.tensor_parallel_size (a
    # mixed worker is a decode worker that prefills too: it takes the decode degree).
    role_tp: dict[Role, int] = field(default_factory=dict)
    # The KV cache's element type of each role's workers where it differs from engine.kv_cache_dtype (mixed
    # take the decode role's): a handoff between two types converts (kv_transfer/conversion.py).
    role_kv_cache_dtype: dict[Role, str] = field(default_factory=dict)
    # Environment of every worker process: UCX_NET_DEVICES, UCX_TLS, NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME...
    worker_env: dict[str, str] = field(default_factory=dict)
    # What each worker loads, resolved on its own node; None: engine.model_dir as it is on every node.
    model_source: ModelSource | None = None
    num_threads: int = 1  # torch threads per worker (ServeConfig: the node's cores split over its workers)
    pin_cpus: bool = True  # each worker pins its process to its own cores
                           # (worker_runtime/worker_setup.py)
    # How long start-up waits for Ray to place every worker; then it serves with those placed if they can
    # serve (the rest stay pending), else fails naming what no node offers. Autoscaled nodes take minutes.
    placement_timeout_s: float = 300.0
    # The cluster autoscales: a layout beyond the resources free now is accepted (gateway/ratio/resize.py)
    # and each added worker waits pending this long for a node before it is given up. None: refused.
    autoscale_wait_s: float | None = None
    start_timeout_s: float = 300.0  # a placed worker that has not loaded its model by then is given up
    # A step running this long, and STEP_WATCHDOG_FACTOR × the worker's longest finished step, is taken for
    # hung: the worker is replaced and its requests move (gateway/fleet/recovery.py). 0: never.
    step_watchdog_s: float = 120.0

    def __post_init__(self) -> None:
        if min(self.num_prefill, self.num_decode, self.num_mixed) < 0:
            raise ValueError(f"worker counts must be >= 0, got {self.layout()}")
        if not can_serve(self.layout()):
            raise ValueError(f"the layout {CANNOT_SERVE}, got {self.layout()}")
        if self.num_threads < 1:
            raise ValueError(f"threads per worker must be >= 1, got {self.num_threads}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        for role, resources in self.role_resources.items():
            # Ray refuses these names as custom resources: they have their own options.
            if {"CPU", "GPU"} & set(resources):
                raise ValueError(f"{role.value} resources: use the CPU/GPU per worker settings, not "
                                 f"{sorted({'CPU', 'GPU'} & set(resources))}")
            if any(amount <= 0 for amount in resources.values()):
                raise ValueError(f"{role.value} resources must be positive amounts, got {resources}")

    def tp_of(self, role: Role) -> int:
        """The tensor-parallel degree of a worker in `role`."""
        own = self.role_tp.get(Role.DECODE if role is Role.MIXED else role)
        return own if own is not None else self.engine.tensor_parallel_size

    def check_degree(self, degree: int, name: str) -> None:
        """ValueError naming `name` if `degree` ranks cannot split the model's heads, where the model's files
        are here to read; elsewhere (resolved on each worker's node) the first worker at it says so."""
        try:
            spec = read_model_spec(self.engine.model_dir)
        except (OSError, ValueError):
            return
        check_tensor_parallel(spec, degree, name)

    def engine_for(self, role: Role) -> EngineConfig:
        """The engine of a worker started in `role` (its degree and KV cache type are fixed for its life)."""
        kv_dtype = self.role_kv_cache_dtype.get(Role.DECODE if role is Role.MIXED else role,
                                                self.engine.kv_cache_dtype)
        own = {"tensor_parallel_size": self.tp_of(role), "kv_cache_dtype": kv_dtype}
        if all(getattr(self.engine, name) == value for name, value in own.items()):
            return self.engine
        return replace(self.engine, **own)  # type: ignore[arg-type]

    def layout(self) -> dict[Role, int]:
        return {Role.PREFILL: self.num_prefill, Role.DECODE: self.num_decode, Role.MIXED: self.num_mixed}

    def resolve_backend(self) -> BackendName:
        if self.backend != "auto":
            return resolve(self.backend).name  # unknown names raise, listing the known ones
        if resolve(BackendName.NIXL).is_available():
            logger.info("KV transfer backend nixl: it imports here (one-sided READ over UCX)")
            return BackendName.NIXL
        if not self.num_prefill and not self.num_decode:
            logger.info("no KV transfer backend: nixl does not import here and every worker is mixed")
            return BackendName.LOCAL
        logger.info("KV transfer backend torch: nixl does not import here")
        return BackendName.TORCH
