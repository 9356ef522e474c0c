"""How big one worker's paged KV cache is: the memory budget, and the blocks it buys.

Pure arithmetic: the caller measures the device's memory (llm_engine/hardware.py device_memory) and passes
the numbers in, so every rule here is unit-tested without a GPU.

    KV memory setting (EngineConfig)      CPU                              CUDA
    kv_cache_bytes = B                    B                                B
    kv_cache_fraction = f                 f × free RAM                     f × free GPU memory
    neither                               CPU_KV_CACHE_BYTES               gpu_memory_utilization × total
                                                                           − weights − activation reserve
                                                                           − NON_TORCH_BYTES   (vLLM's rule)
Memory is measured after the weights are loaded, per worker: several workers on one node each take their own
budget (with a fraction, each takes that fraction of what is free when it starts). The budget must fit in the
free memory and hold at least one block; otherwise a ValueError names the setting to change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from llm_engine.config import CPU_KV_CACHE_BYTES, EngineConfig, ModelSpec
from llm_engine.hardware import DeviceMemory
from llm_engine.params import PROMPT_ROWS_PER_SLICE

if TYPE_CHECKING:
    from llm_engine.kv_cache import KVCacheSpec

GiB = 1 << 30
# Memory a CUDA worker uses outside torch's allocator (CUDA context, cuBLAS workspace), which
# torch.cuda.memory_allocated does not see. An estimate: vLLM measures it; ours is what a context takes on
# current GPUs, rounded up.
NON_TORCH_BYTES = 768 << 20
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class MemoryAmount:
    """A memory setting as given: bytes, or a fraction of the free memory (exactly one is set)."""

    num_bytes: int | None = None
    fraction: float | None = None


def parse_memory(value: str | int | float) -> MemoryAmount:
    """'2GiB', '512MiB', '1.5G' (K/M/G/T alone are binary, KB/MB/GB/TB decimal), a whole number of bytes, or
    a fraction in (0, 1] such as 0.2.

    Raises:
        ValueError: anything else (the message says what is accepted).
    """
    accepted = "give bytes with a unit (2GiB, 512MiB), a whole number of bytes, or a fraction in (0, 1]"
    if isinstance(value, bool):
        raise ValueError(f"{value!r}: {accepted}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"{value}: {accepted}")
        return MemoryAmount(num_bytes=value)
    if isinstance(value, float):
        return _fraction(value, accepted)
    match = _MEMORY.match(value)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{value!r}: {accepted}")
    number, unit = match.group(1), match.group(2).lower()
    if not unit and "." in number:
        return _fraction(float(number), accepted)
    num_bytes = int(float(number) * _UNITS[unit]) if "." in number else int(number) * _UNITS[unit]
    if num_bytes < 1:
        raise ValueError(f"{value!r}: {accepted}")
    return MemoryAmount(num_bytes=num_bytes)


def _fraction(value: float, accepted: str) -> MemoryAmount:
    if not 0 < value <= 1:
        raise ValueError(f"{value}: {accepted}")
    return MemoryAmount(fraction=value)


def activation_reserve_bytes(spec: ModelSpec, config: EngineConfig, dtype_bytes: int) -> int:
    """An upper estimate of one forward's transient memory at the config's limits (one layer's worth: the
    layers run one after another), summed over what may be alive at once:
    the hidden states of max_num_batched_tokens tokens (residual, norm, q/k/v/o, the MLP's gate, up and
    product); a prompt chunk's attention scores and softmax over the whole context (SDPA's math path, which a
    masked grouped-query attention takes on CUDA); the decode rows' gathered K and V over the whole context;
    and the float32 logits of the rows projected to the vocabulary (raw, processed, probabilities)."""
    num_tokens, num_seqs, context = config.max_num_batched_tokens, config.max_num_seqs, spec.max_model_len
    q_kv_width = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    hidden = num_tokens * (4 * spec.hidden_size + q_kv_width + 3 * spec.intermediate_size) * dtype_bytes
    prefill_scores = 2 * spec.num_heads * num_tokens * context * dtype_bytes
    decode_kv = num_seqs * context * 2 * spec.num_kv_heads * spec.head_dim * dtype_bytes
    logits = 3 * (num_seqs + PROMPT_ROWS_PER_SLICE) * spec.vocab_size * 4
    return hidden + prefill_scores + decode_kv + logits


@dataclass(frozen=True)
class KVBudget:
    num_bytes: int  # what the KV cache may take
    source: str  # how it was reached, for the start-up log ("0.2 of 20.10 GiB free RAM")


def kv_budget(config: EngineConfig, memory: DeviceMemory, activation_bytes: int) -> KVBudget:
    """The KV cache's bytes for this worker (see the module docstring's table).

    Raises:
        ValueError: the budget does not fit in the free memory, or nothing is left for it.
    """
    is_cuda = config.device.startswith("cuda")
    where = "GPU memory" if is_cuda else "RAM"
    if config.kv_cache_fraction is not None:
        num_bytes = int(config.kv_cache_fraction * memory.free)
        return KVBudget(num_bytes, f"{config.kv_cache_fraction:g} of {_gib(memory.free)} free {where}")
    if config.kv_cache_bytes is not None or not is_cuda:
        num_bytes = CPU_KV_CACHE_BYTES if config.kv_cache_bytes is None else config.kv_cache_bytes
        if num_bytes > memory.free:
            raise ValueError(f"a KV cache of {_gib(num_bytes)} does not fit in the {_gib(memory.free)} of "
                             f"free {where} on this node: lower --kv-cache-memory")
        return KVBudget(num_bytes, "--kv-cache-memory" if config.kv_cache_bytes is not None
                        else f"the CPU default of {_gib(num_bytes)}")
    utilization = config.gpu_memory_utilization
    requested = int(utilization * memory.total)
    # What this worker may have: free memory plus what its own allocator holds already (its weights).
    if memory.free + memory.held < requested:
        raise ValueError(
            f"free GPU memory ({_gib(memory.free + memory.held)} of {_gib(memory.total)}, this worker's "
            f"weights included) is less than --gpu-memory-utilization {utilization:g} asks for "
            f"({_gib(requested)}): lower it, or free the GPU of other processes")
    num_bytes = requested - memory.weights - activation_bytes - NON_TORCH_BYTES
    if num_bytes < 1:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} ({_gib(requested)}) leaves no room for the KV cache "
            f"after the weights ({_gib(memory.weights)}), the activations ({_gib(activation_bytes)}: "
            f"--max-num-batched-tokens, --max-num-seqs and --max-model-len size them) and "
            f"{_gib(NON_TORCH_BYTES)} outside torch: raise it or lower those")
    return KVBudget(num_bytes, f"{utilization:g} of {_gib(memory.total)} GPU memory − weights "
                               f"{_gib(memory.weights)} − activations {_gib(activation_bytes)} − "
                               f"{_gib(NON_TORCH_BYTES)} outside torch")


@dataclass(frozen=True)
class KVCapacity:
    """What one worker's KV cache holds (logged at start, shown per worker in GET /admin/pools)."""

    num_blocks: int
    block_size: int  # tokens per block
    num_bytes: int  # the cache tensor's size
    source: str  # how its budget was reached

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (f"KV cache: {self.num_blocks} blocks × {self.block_size} tokens = {self.num_tokens} tokens, "
                f"{_gib(self.num_bytes)} (from {self.source})")


def kv_capacity(budget: KVBudget, block_bytes: int, block_size: int) -> KVCapacity:
    """The whole blocks of `block_bytes` that the budget buys.

    Raises:
        ValueError: not even one block.
    """
    num_blocks = budget.num_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(f"a KV budget of {budget.num_bytes} bytes ({budget.source}) holds no block of "
                         f"{block_bytes} bytes ({block_size} tokens): raise the KV memory")
    return KVCapacity(num_blocks, block_size, num_blocks * block_bytes, budget.source)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB" if num_bytes >= GiB else f"{num_bytes / (1 << 20):.1f} MiB"


def plan_kv_cache(config: EngineConfig, spec: ModelSpec, memory: DeviceMemory) -> KVCapacity:
    """The KV capacity of a worker with this config and model (spec with its effective max_model_len) on a
    device with this memory.

    Raises:
        ValueError: the budget does not fit, or holds no block.
    """
    from llm_engine.kv_cache import KVCacheSpec  # here: it brings torch, and the gateway parses memory here

    cache: KVCacheSpec = KVCacheSpec.from_model(spec, config)
    # Only gpu_memory_utilization's rule leaves room for activations: a named KV size is taken as is (vLLM).
    is_utilization = (config.device.startswith("cuda") and config.kv_cache_bytes is None
                      and config.kv_cache_fraction is None)
    activation = (activation_reserve_bytes(spec, config, config.torch_dtype.itemsize)
                  + config.transfer_scratch_bytes
                  if is_utilization else 0)
    # Tensor parallel: every rank takes as many blocks as rank 0 can hold (rank 0's share of the heads is the
    # largest). With staging (the torch backend: llm_engine/tensor_parallel.py) rank 0 also holds a
    # whole-head copy of each block for the KV that leaves or arrives, and the budget pays for both.
    block_bytes = cache.block_bytes
    if config.tensor_parallel_size > 1 and config.tp_staging:
        block_bytes += replace(cache, num_kv_heads=spec.num_kv_heads).block_bytes
    capacity = kv_capacity(kv_budget(config, memory, activation), block_bytes, config.block_size)
    return replace(capacity, num_bytes=capacity.num_blocks * cache.block_bytes)  # the rank's own cache
