"""Engine configuration (what the operator chooses) and the model's shape (what the checkpoint says)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from llm_engine.hardware import resolve_device, resolve_dtype

if TYPE_CHECKING:
    import torch

# Families whose attention is plain causal attention over rotary q/k (what the paged attention computes):
# each is tested token-equal to transformers (tests/engine/test_model_families.py). Not Gemma 2/3: their
# attention logits are soft-capped and alternate layers slide, which the paged attention does not do.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "GemmaForCausalLM", "Phi3ForCausalLM")
DECODE_ATTENTION_CHOICES = ("auto", "sdpa", "paged-kernel")
COMPILE_CHOICES = ("auto", "on", "off")
# vLLM's names of the 8-bit KV types, and torch's (llm_engine/kv_dtype.py); "auto" is the model's dtype.
EIGHT_BIT_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
KV_CACHE_DTYPE_NAMES = ("auto", *EIGHT_BIT_KV_DTYPES, "int8_per_token_head")
MiB = 1 << 20
# The KV cache of a CPU worker when no KV memory is named (on CUDA: gpu_memory_utilization decides).
CPU_KV_CACHE_BYTES = 512 * MiB


# The GEMM kernels of llm_engine/linear_kernels.py. Here, not there: naming one in a config must not load the
# kernels (nor register the engine's torch ops, llm_engine/custom_ops.py).
class LinearKernel(StrEnum):
    AUTO = "auto"  # probe at load and keep the fastest per shape and band (CPU); cuBLAS on CUDA
    TORCH = "torch"  # F.linear as torch dispatches it: MKL (CPU fp32), oneDNN (CPU bf16), cuBLAS (CUDA)
    ONEDNN_PACKED = "onednn-packed"  # oneDNN with weights reordered once at load (CPU only)
    ZENTORCH = "zentorch"  # ZenDNN's linear (AMD CPUs, the optional extra pdserve[zen])


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker's engine needs; checked once, here."""

    model_dir: str  # a local Hugging Face model directory
    # Weights and KV cache: "auto" (bfloat16 where the hardware runs it natively, else float32: resolved
    # here, so the config that reaches a worker names a concrete dtype), "float32", "bfloat16", "float16"
    # (CUDA only).
    dtype: str = "auto"
    # "auto" (the default: cuda where this process sees a GPU, else cpu; resolved here, so the config that
    # reaches a worker names a concrete device), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    block_size: int = 16  # tokens per KV block
    # The KV cache's element type (llm_engine/kv_dtype.py): "auto" (the model's dtype), or 8-bit floats as
    # vLLM names them, "fp8" (= "fp8_e4m3") or "fp8_e5m2": half of bfloat16's bytes a token, kept and moved.
    kv_cache_dtype: str = "auto"
    # The paged KV cache's memory (llm_engine/kv_sizing.py): bytes, or a fraction of the device's free memory
    # (RAM on a CPU, GPU memory on CUDA), at most one of them. Neither: CPU_KV_CACHE_BYTES on a CPU; on CUDA
    # gpu_memory_utilization × the GPU's memory, less weights and activations.
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float | None = None
    gpu_memory_utilization: float = 0.9  # CUDA: share of the GPU's total memory this worker may use (vLLM's)
    max_model_len: int | None = None  # prompt + output tokens per request; None: the model's own
    max_num_batched_tokens: int = 512  # tokens one forward may carry (prefill chunking budget)
    max_num_seqs: int = 64  # requests one forward may carry
    # Seconds of prompt work one forward may add while requests decode on the same worker (a mixed worker,
    # or a decode worker recomputing a moved stream): prompts are sliced to fit, from measured step times
    # (worker_runtime/prefill_slicer.py). 0 (the default): no limit beyond max_num_batched_tokens.
    # Off by default because on a CPU small slices cost prefill throughput (benchmarks/README.md, mixed_stall:
    # 0.1 s bounded the largest gap from 0.65 to 0.19 s but cost a third of 16-client throughput).
    max_prefill_s_beside_decode: float = 0.0
    enable_prefix_caching: bool = True  # share full blocks of identical prefixes between requests
    # GEMM kernel of every linear layer (llm_engine/linear_kernels.py). PDSERVE_LINEAR_KERNEL sets the default
    # (the test suite's fleets run torch: auto's probe imports zentorch on AMD CPUs, and with it dynamo and
    # inductor, 2.8 s of every worker start; the probe and each kernel have their own tests).
    linear_kernel: str = field(default_factory=lambda: os.environ.get("PDSERVE_LINEAR_KERNEL", "auto"))
    # Decode attention: "auto" (the C++ kernel on a CPU where it builds, else SDPA; model_runner.py says
    # why), "sdpa" (gather each sequence's KV, torch SDPA) or "paged-kernel" (pdserve's C++ kernel,
    # llm_engine/csrc/: reads each sequence's own blocks in place; CPU only; in bf16 not bit-identical to
    # transformers).
    decode_attention: str = "auto"
    # The model body as one compiled graph (llm_engine/compilation.py): "auto" (compile where the family has
    # the engine's own body; eager, with the reason logged, if compiling fails), "on" (a failure stops the
    # worker) or "off". PDSERVE_COMPILE sets the default (the test suite runs eager: a compile per fleet
    # start would cost minutes; tests/engine/test_compiled_engine.py covers the compiled path).
    compile: str = field(default_factory=lambda: os.environ.get("PDSERVE_COMPILE", "auto"))
    # Under "auto", where it compiles: serve eager from the load and compile beside serving, the compiled
    # body swapped in once done (a serving worker: pdserve serve sets it); False: compile before the engine
    # is ready (offline use, benchmarks of the compiled steps).
    compile_in_background: bool = False
    # Ranks (processes) one worker's model is split over (llm_engine/tensor_parallel.py): each holds
    # 1/tensor_parallel_size of every layer's heads, MLP and KV cache.
    tensor_parallel_size: int = 1
    # Rank 0 of a tensor-parallel worker keeps a whole-head staging copy of the cache, for KV that leaves or
    # arrives through its process alone (the torch and local transfer backends). False where the transfer
    # backend reads each rank's heads where they live (NIXL: kv_transfer/head_slices.py): no copy to pay for.
    tp_staging: bool = True
    # Device memory each rank's transfer layer takes beside the KV cache (NIXL rank slices' scratch: set by
    # the worker); --gpu-memory-utilization's KV budget leaves it out, as it leaves out the activations.
    transfer_scratch_bytes: int = 0

    def __post_init__(self) -> None:
        problems = []
        try:
            object.__setattr__(self, "device", resolve_device(self.device))
        except ValueError as error:
            problems.append(str(error))
        else:
            try:
                object.__setattr__(self, "dtype", resolve_dtype(self.dtype, self.device))
            except ValueError as error:
                problems.append(str(error))
        if self.decode_attention not in DECODE_ATTENTION_CHOICES:
            problems.append(f"decode_attention must be one of {', '.join(DECODE_ATTENTION_CHOICES)}, "
                            f"got {self.decode_attention!r}")
        elif self.decode_attention == "paged-kernel" and self.device != "cpu":
            problems.append("decode_attention 'paged-kernel' is a CPU kernel; on CUDA use auto or sdpa")
        if self.compile not in COMPILE_CHOICES:
            problems.append(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")
        if self.linear_kernel not in tuple(LinearKernel):
            problems.append(f"linear_kernel must be one of {', '.join(LinearKernel)}, "
                            f"got {self.linear_kernel!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, "
                            f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            problems.append(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_cache_fraction is not None and not 0 < self.kv_cache_fraction <= 1:
            problems.append(f"kv_cache_fraction must be in (0, 1], got {self.kv_cache_fraction}")
        if self.kv_cache_bytes is not None and self.kv_cache_fraction is not None:
            problems.append("give kv_cache_bytes or kv_cache_fraction, not both")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            problems.append(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_prefill_s_beside_decode < 0:
            problems.append("max_prefill_s_beside_decode must be >= 0, got "
                            f"{self.max_prefill_s_beside_decode}")
        if self.max_num_batched_tokens < 1:
            problems.append(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            problems.append(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here: the gateway reads this config without torch

        dtype: torch.dtype = getattr(torch, self.dtype)  # a name of hardware.DTYPE_NAMES
        return dtype


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a loaded model that the KV cache, the scheduler and the transfer layer need."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int  # the MLP's width
    vocab_size: int
    max_model_len: int  # prompt + output tokens one request may hold
    eos_token_ids: tuple[int, ...]
    # The linear layers' weights: "unquantized", or the checkpoint's integer scheme ("w8a8", "w4a16-g64";
    # llm_engine/weight_schemes.py)
    weights: str = "unquantized"

    def with_max_model_len(self, max_model_len: int | None) -> ModelSpec:
        """This spec with a shorter context (None: as it is).

        Raises:
            ValueError: longer than the model's own context (its positions past that are untrained).
        """
        if max_model_len is None:
            return self
        if max_model_len > self.max_model_len:
            raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context of "
                             f"{self.max_model_len} tokens")
        return replace(self, max_model_len=max_model_len)
