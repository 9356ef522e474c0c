"""How each worker's engine runs: dtype, device, kernels, threads, KV sizing and tensor parallelism. A field
left unset takes the engine's own default (llm_engine/config.py), not repeated here."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from llm_engine.kv_sizing import parse_memory

KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head"]  # KV_CACHE_DTYPE_NAMES
WireDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]  # llm_engine/config.py EIGHT_BIT_KV_DTYPES


class EngineSettings(BaseModel):
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None,
        description="auto, float32, bfloat16, or float16 (CUDA only) (default: the engine's, auto: bfloat16 "
                    "where the hardware runs it natively: AVX512_BF16 or AMX on a CPU, any CUDA GPU; else "
                    "float32)")
    device: str | None = Field(
        None, description="auto, cpu, cuda or cuda:N (default: the engine's, auto: cuda where this process "
                          "sees a GPU, else cpu; on a cluster whose head has no GPU, give cuda)")
    compile: Literal["auto", "on", "off"] | None = Field(
        None,
        description="the model body as one compiled graph (torch.compile, inductor): auto (compile where it "
                    "wins: CUDA, and CPUs that compute bfloat16 natively, beside serving: a worker serves "
                    "eager from its load and swaps the compiled body in when it is done; eager elsewhere, "
                    "and eager with the reason logged if compiling fails), on (compiled before the worker "
                    "serves; a failure stops it) or off (default: the engine's, auto)")
    linear_kernel: Literal["auto", "torch", "onednn-packed", "zentorch"] | None = Field(
        None,
        description="GEMM kernel of the linear layers: auto, torch (F.linear), onednn-packed (CPU: weights "
                    "prepacked once) or zentorch (AMD CPUs, the extra pdserve[zen]) (default: the engine's, "
                    "auto: probed at load, per weight shape and band of row counts)")
    decode_attention: Literal["auto", "sdpa", "paged-kernel"] | None = Field(
        None,
        description="sdpa (gather + torch SDPA padded to the batch's longest context, bit-identical to "
                    "transformers) or paged-kernel (pdserve's C++ kernel, CPU only: each sequence reads only "
                    "its own context) (default: the engine's, auto: paged-kernel on a CPU where it builds)")
    threads_per_worker: int | None = Field(
        None, ge=1,
        description="torch threads per worker; each worker is pinned to its own cores (default: this "
                    "machine's cores split over the starting layout's workers; on a cluster, "
                    "--cpus-per-worker)")
    pin_cpus: bool = Field(
        True,
        description="pin each worker to its own cores (--no-pin-cpus: the OS places the workers' threads)")
    block_size: int | None = Field(None, ge=1, description="tokens per KV block (default: the engine's)")
    kv_cache_dtype: KVCacheDtype | None = Field(
        None,
        description="the KV cache's element type, vLLM's names: auto (the model's dtype); fp8 (= fp8_e4m3) / "
                    "fp8_e5m2: 8-bit floats, twice the tokens in the same memory and half the bytes a "
                    "handoff moves; int8_per_token_head: int8 with a float32 scale per token and head (1.88× "
                    "the tokens at head dim 64), the scales moving with their blocks (default: the engine's, "
                    "auto)")
    prefill_kv_cache_dtype: KVCacheDtype | None = Field(
        None,
        description="the prefill workers' KV cache type (default: --kv-cache-dtype); where it differs from "
                    "the decode workers', each handoff converts on arrival (the wire carries the prefill "
                    "worker's bytes)")
    decode_kv_cache_dtype: KVCacheDtype | None = Field(
        None,
        description="the decode and mixed workers' KV cache type (default: --kv-cache-dtype), e.g. fp8 for "
                    "twice the streams beside prefill workers that keep the model's dtype")
    kv_transfer_dtype: WireDtype | None = Field(
        None,
        description="the element type KV crosses the wire in: auto (each sender's cache's own) or fp8 / "
                    "fp8_e5m2: a sender whose cache keeps more bits converts each offered block to 8 bits "
                    "(half a bfloat16 handoff's bytes, rounded once), the receiver back into its own type; "
                    "the sender holds an 8-bit copy of its cache for it (default: auto)")
    # Sizing (llm_engine/kv_sizing.py; None: the engine's default).
    max_model_len: int | None = Field(
        None, ge=1,
        description="prompt + output tokens one request may hold (default: the model's own context; more is "
                    "refused)")
    max_num_seqs: int | None = Field(
        None, ge=1, description="requests one forward may carry (default: the engine's, 64)")
    kv_cache_memory: str | int | float | None = Field(
        None,
        description="KV cache per worker: bytes (2GiB, 512MiB) or a fraction of the free memory (0.2: of "
                    "free RAM on a CPU, of free GPU memory on CUDA) as each worker starts (default: 512MiB "
                    "on a CPU; on CUDA --gpu-memory-utilization decides); wins over --kv-cache-mib")
    kv_cache_mib: int | None = Field(
        None, ge=1,
        description="the old form of --kv-cache-memory NMiB, which wins when both are given (default: unset)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="CUDA: share of the GPU's total memory each worker may use; the KV cache gets what the "
                    "weights and activations leave (default: the engine's, 0.9; --kv-cache-memory overrides "
                    "it)")
    max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="tokens per forward, the prefill chunk budget (default: the engine's)")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="ranks (processes, each a Ray actor on the worker's node) each worker's model is split "
                    "over, Megatron-style: each holds 1/N of every layer's heads, MLP and KV cache; N must "
                    "divide the model's attention and KV heads")
    prefill_tp: int | None = Field(
        None, ge=1,
        description="the prefill workers' tensor-parallel degree (default: --tensor-parallel-size)")
    decode_tp: int | None = Field(
        None, ge=1,
        description="the decode and mixed workers' tensor-parallel degree (default: --tensor-parallel-size); "
                    "KV moves between workers of any two degrees")
    max_prefill_s_beside_decode: float | None = Field(
        None, ge=0,
        description="seconds of prompt work a worker adds to a step while it also decodes (mixed workers): "
                    "prompts are sliced to fit, from measured step times, so streams there are not stalled by"
                    " a whole prompt chunk (default: the engine's, 0: off; it costs prefill throughput on a "
                    "CPU, see README)")

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_memory_parses(cls, value: str | int | float | None) -> str | int | float | None:
        if value is not None:
            parse_memory(value)
        return value

    def kv_cache_dtypes(self) -> tuple[str, str]:
        """The KV cache type of the prefill workers, then of the decode and mixed ones (auto: the model's)."""
        default = self.kv_cache_dtype or "auto"
        return (self.prefill_kv_cache_dtype or default, self.decode_kv_cache_dtype or default)

    def tp_degrees(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(the flag that sets it, the degree) of the prefill workers, then of the decode and mixed ones."""
        return (("--prefill-tp", self.prefill_tp) if self.prefill_tp else
                ("--tensor-parallel-size", self.tensor_parallel_size),
                ("--decode-tp", self.decode_tp) if self.decode_tp else
                ("--tensor-parallel-size", self.tensor_parallel_size))
