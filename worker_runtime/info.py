"""Who a worker is and where and how it runs: the records the actor answers with and the gateway reads
(/admin/pools, the metrics, placement), torch-free so that the gateway reads them without the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker_runtime.roles import Role

if TYPE_CHECKING:
    from llm_engine.engine import LLMEngine


@dataclass(frozen=True)
class WorkerInfo:
    """Who the worker is, for /admin/pools and for tests that check a role change kept the process."""

    worker_id: str
    role: Role
    actor_id: str  # Ray's id of this actor: the same after any number of role changes
    pid: int
    num_model_loads: int  # weight loads in this process: 1 however often the role changed
    num_role_changes: int
    runtime: WorkerRuntime | None = None  # what the engine runs on; None until start()


@dataclass(frozen=True)
class WorkerRuntime:
    """How the worker computes: dtype, weights, GEMM kernel and cores (in /admin/pools and the metrics)."""

    dtype: str  # of activations and KV cache (and of the weights, unquantized), "auto" resolved
    linear_kernel: str  # "torch", or the kernels in use ("onednn-packed+zentorch"; llm_engine/linear_kernels)
    linear_kernel_reason: str  # the probe's verdict, or why there was none
    linear_kernel_speedup: float | None  # probe: F.linear time over the chosen kernels' (None: no probe)
    decode_attention: str  # "paged-kernel" (pdserve's C++ kernel) or "sdpa" (gather + torch SDPA)
    compile: str  # the model body: "compiled" (one inductor graph, llm_engine/compilation.py) or "eager"
    compile_reason: str  # why (auto's verdict, a failure's reason), and which body: "lean" or "transformers"
    num_threads: int  # torch threads of the step loop
    cpu_ids: tuple[int, ...]  # cores the process is pinned to (all it may use when not pinned)
    kv_bytes_per_token: int  # KV bytes one token holds and moves between workers
    num_kv_blocks: int
    num_kv_tokens: int  # what those blocks hold: the most one request may use here
    kv_cache_bytes: int
    kv_cache_source: str  # how its memory was sized (llm_engine/kv_sizing.py), e.g. "0.2 of 20 GiB free RAM"
    # Ranks its model is split over (llm_engine/tensor_parallel.py); kv_cache_bytes is each rank's.
    tensor_parallel_size: int = 1
    tp_rank_pids: tuple[int, ...] = ()  # the processes of ranks 1.. (pool_worker/tp_ranks.py)
    # How KV leaves and arrives at several ranks: "rank slices" (each rank's heads read where they live,
    # kv_transfer/head_slices.py) or "rank 0 staging" (whole-head blocks through rank 0); "" at one rank.
    tp_kv_handoff: str = ""
    # The linear layers' weights: "unquantized", or the checkpoint's integer scheme ("w8a8", "w4a16-g64")
    weights: str = "unquantized"
    # The KV cache's elements: the model's dtype, "float8_e4m3fn" (fp8), or "int8_per_token_head"
    kv_dtype: str = ""

    @classmethod
    def of(cls, engine: LLMEngine, num_threads: int, cpu_ids: tuple[int, ...],
           tp_rank_pids: tuple[int, ...] = ()) -> WorkerRuntime:
        """Read from a loaded engine and the process's thread and core settings."""
        kernel, kv = engine.linear_kernel, engine.kv_capacity
        return cls(engine.config.dtype, kernel.label, kernel.reason, kernel.speedup,
                   engine.runner.decode_attention, engine.compilation.mode,
                   f"{engine.compilation.body} body: {engine.compilation.reason}", num_threads, cpu_ids,
                   # A token's KV over every rank: what moves between workers.
                   engine.kv_block_bytes // engine.config.block_size,
                   kv.num_blocks, kv.num_tokens, kv.num_bytes,
                   kv.source, engine.config.tensor_parallel_size, tp_rank_pids,
                   "" if engine.mirror is None else "rank 0 staging" if engine.stages_kv else "rank slices",
                   engine.spec.weights, kv_dtype_label(engine))


def kv_dtype_label(engine: LLMEngine) -> str:
    """What the cache's elements are: the torch dtype, or the int8 scheme's name (its int8 values carry
    scales: llm_engine/kv_dtype.py)."""
    dtype = str(engine.runner.kv_cache.dtype).removeprefix("torch.")
    return engine.config.kv_cache_dtype if dtype == "int8" else dtype


@dataclass(frozen=True)
class WorkerPlacement:
    """Where Ray placed the worker: answered by the constructor's process before any model loads."""

    node_id: str  # Ray's node id (hex)
    node_ip: str  # the node's address as Ray knows it: what peers on other nodes connect to
    pid: int


@dataclass(frozen=True)
class WorkerStanding:
    """What a worker tells a fleet actor that Ray restarted, for it to adopt the worker as it is
    (gateway/fleet/adoption.py): who, where, on which cores, and whether it serves."""

    info: WorkerInfo  # its runtime is None until start() has loaded the model
    placement: WorkerPlacement
    cpu_slot: int | None  # the slot start() pinned it to
    is_serving: bool  # started, with a front in its role (not between two roles)
