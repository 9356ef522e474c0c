"""The torch side of a worker actor's start: the engine loaded (one process, or rank 0 of a tensor-parallel
group whose other ranks it starts on this node) and the role's worker built over it.

pool_worker/actor.py imports this module in start() only. Ray imports the actor's module wherever one of its
handles is unpickled (to read the actor's methods), frontends included: at module level the actor holds
nothing that imports torch, so a frontend that calls workers holds none either
(tests/architecture/test_torch_free_frontend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import get_current_placement_group

from decode_pool.worker import DecodeWorker
from kv_transfer import BackendName, TransferConfig
from llm_engine.config import EngineConfig
from llm_engine.engine import LLMEngine
from llm_engine.model_loader import num_model_loads
from llm_engine.tensor_parallel import TPGroup, TPRank, bind_group_address
from pool_worker.tp_ranks import TPRanks
from prefill_pool.worker import PrefillWorker
from worker_runtime.info import WorkerPlacement
from worker_runtime.output_channels import OutputChannels
from worker_runtime.roles import Role

TP_START_TIMEOUT_S = 600.0  # the other ranks load their slices while rank 0 loads its own

__all__ = ["LoadedEngine", "build_worker", "load_engine"]


@dataclass(frozen=True)
class LoadedEngine:
    engine: LLMEngine
    tp_ranks: TPRanks | None  # ranks 1.. of a tensor-parallel worker
    num_model_loads: int  # in this process so far (a role change or an adoption loads nothing again)


def load_engine(worker_id: str, config: EngineConfig, placement: WorkerPlacement,
                num_threads: int) -> LoadedEngine:
    engine, ranks = (_start_tp_group(worker_id, config, placement, num_threads)
                     if config.tensor_parallel_size > 1 else (LLMEngine(config), None))
    return LoadedEngine(engine, ranks, num_model_loads())


def _start_tp_group(worker_id: str, config: EngineConfig, placement: WorkerPlacement, num_threads: int
                    ) -> tuple[LLMEngine, TPRanks]:
    """Rank 0 of a tensor-parallel worker: the other ranks started on this node (pool_worker/tp_ranks.py),
    the group joined, and this rank's engine built over it."""
    size = config.tensor_parallel_size
    tp = TPRank(0, size, bind_group_address(placement.node_ip, size),
                "nccl" if config.device.startswith("cuda") else "gloo")
    gpu_ids = [str(i) for i in ray.get_gpu_ids()]
    # Rank 0's own GPU in the worker's placement group (a bundle per rank); without one, every rank's.
    needed = 1 if get_current_placement_group() is not None else size
    held = ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)
    if gpu_ids and (len(gpu_ids) < needed or held < needed):
        raise RuntimeError(f"{worker_id}: each of its {size} tensor-parallel ranks needs a GPU of "
                           f"its own; Ray gave rank 0 {held:g} (--gpus-per-worker is per rank: give 1)")
    ranks = TPRanks.create(worker_id, tp, config, config.model_dir, num_threads, placement.node_id, gpu_ids)
    try:
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        ranks.wait_started(TP_START_TIMEOUT_S)
    except BaseException:
        ranks.kill()
        raise
    return engine, ranks


def build_worker(role: Role, worker_id: str, engine: LLMEngine, backend: BackendName,
                 transfer_config: TransferConfig, outputs: OutputChannels, watermark: float,
                 num_threads: int) -> PrefillWorker | DecodeWorker:
    """The role's worker over the loaded engine (a role change builds another over the same engine)."""
    if role is Role.PREFILL:
        return PrefillWorker.create(worker_id, engine, backend, transfer_config, outputs, num_threads)
    return DecodeWorker.create(worker_id, engine, backend, transfer_config, outputs, watermark, num_threads)
