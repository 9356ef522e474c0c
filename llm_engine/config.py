"""Engine configuration (what the operator chooses) and the model's shape (what the checkpoint says)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_engine.hardware import DTYPES, resolve_dtype
from llm_engine.linear_kernels import LinearKernel

# Families whose attention is plain causal attention over rotary q/k (what the paged attention computes):
# each is tested token-equal to transformers (tests/engine/test_model_families.py). Not Gemma 2/3: their
# attention logits are soft-capped and alternate layers slide, which the paged attention does not do.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "GemmaForCausalLM", "Phi3ForCausalLM")
DECODE_ATTENTION_CHOICES = ("auto", "sdpa", "paged-kernel")
MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Everything one worker's engine needs; checked once, here."""

    model_dir: str  # a local Hugging Face model directory
    # Weights and KV cache: "auto" (bfloat16 where the hardware runs it natively, else float32: resolved
    # here, so the config that reaches a worker names a concrete dtype), "float32", "bfloat16", "float16"
    # (CUDA only).
    dtype: str = "auto"
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    block_size: int = 16  # tokens per KV block
    kv_cache_bytes: int = 512 * MiB  # memory budget of the paged KV cache
    max_num_batched_tokens: int = 512  # tokens one forward may carry (prefill chunking budget)
    max_num_seqs: int = 64  # requests one forward may carry
    # Seconds of prompt work one forward may add while requests decode on the same worker (a mixed worker,
    # or a decode worker recomputing a moved stream): prompts are sliced to fit, from measured step times
    # (pool_worker/runtime/prefill_slicer.py). 0 (the default): no limit beyond max_num_batched_tokens.
    # Off by default because on a CPU small slices cost prefill throughput (benchmarks/results/mixed_stall/:
    # 0.1 s bounded the largest gap from 0.65 to 0.19 s but cost a third of 16-client throughput).
    max_prefill_s_beside_decode: float = 0.0
    enable_prefix_caching: bool = True  # share full blocks of identical prefixes between requests
    linear_kernel: str = "auto"  # GEMM kernel of every linear layer (llm_engine/linear_kernels.py)
    # Decode attention: "auto" (today: SDPA, model_runner.py says why), "sdpa" (gather each sequence's KV,
    # torch SDPA) or "paged-kernel" (pdserve's C++ kernel, llm_engine/csrc/: reads the blocks in place; CPU
    # only; in bf16 not bit-identical to transformers).
    decode_attention: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            problems.append(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
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
        if self.linear_kernel not in tuple(LinearKernel):
            problems.append(f"linear_kernel must be one of {', '.join(LinearKernel)}, "
                            f"got {self.linear_kernel!r}")
        if self.block_size < 1:
            problems.append(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_bytes < 1:
            problems.append(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.max_prefill_s_beside_decode < 0:
            problems.append("max_prefill_s_beside_decode must be >= 0, got "
                            f"{self.max_prefill_s_beside_decode}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            problems.append("max_num_batched_tokens and max_num_seqs must be >= 1")
        if problems:
            raise ValueError("invalid engine config: " + "; ".join(problems))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass(frozen=True)
class ModelSpec:
    """The shape facts of a loaded model that the KV cache, the scheduler and the transfer layer need."""

    architecture: str  # e.g. "LlamaForCausalLM"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int  # prompt + output tokens one request may hold
    eos_token_ids: tuple[int, ...]
