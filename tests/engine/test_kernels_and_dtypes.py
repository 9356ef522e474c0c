"""The engine's fast paths keep transformers' greedy tokens, per dtype and per linear kernel; `auto` choices.

- fp32: a batch of requests of different lengths, with linears on F.linear, on oneDNN prepacked weights and
  (on AMD CPUs with the extra installed) on zentorch.
- bf16: each request served alone is token-identical to transformers in bf16 with either kernel (in a batch,
  bf16 GEMM rounding depends on the batch's shape, as in every batched server: docs/design.md, "Speed").
- The probe falls back to F.linear where oneDNN is missing or fails, and leaves zentorch out where it cannot
  run (not AMD, not installed, bf16 without AVX512_BF16); `--dtype auto` reads the CPU's flags.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_engine import EngineConfig, KVCacheSpec, LLMEngine, SamplingParams, linear_kernels
from llm_engine.config import LinearKernel
from llm_engine.hardware import resolve_dtype
from llm_engine.linear_kernels import (
    PackedLinear,
    onednn_unavailable_reason,
    zentorch_unavailable_reason,
)
from llm_engine.model_files import read_model_spec
from llm_engine.native_kernels import paged_decode_attention
from tests.helpers.reference import hf_greedy, random_prompts
from worker_runtime.worker_setup import cores_for_slot

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
CPU = torch.device("cpu")
KERNELS = ["torch", pytest.param("onednn-packed", marks=pytest.mark.skipif(
    onednn_unavailable_reason(torch.float32, CPU) is not None, reason="no oneDNN here")),
    pytest.param("zentorch", marks=pytest.mark.skipif(
        zentorch_unavailable_reason(torch.float32, CPU) is not None, reason="no zentorch here"))]


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny_llama_dir" if request.param == "tiny" else "smollm2_dir")


def engine_for(model_dir: Path, dtype: str, kernel: str, attention: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, linear_kernel=kernel,
                                  decode_attention=attention, kv_cache_bytes=32 << 20))


@pytest.mark.parametrize("attention", ["sdpa", pytest.param("paged-kernel", marks=pytest.mark.skipif(
    paged_decode_attention() is None, reason="the C++ kernel does not build here"))])
@pytest.mark.parametrize("kernel", KERNELS)
def test_float32_batch_is_token_identical_on_each_kernel(model_dir: Path, kernel: str,
                                                         attention: str) -> None:
    engine = engine_for(model_dir, "float32", kernel, attention)
    assert engine.linear_kernel.kernel == kernel and engine.runner.decode_attention == attention
    is_packed = [isinstance(m, PackedLinear) for m in engine.runner.model.modules()]
    assert sum(is_packed) == (0 if kernel == "torch" else engine.linear_kernel.num_linears)
    prompts = random_prompts([5, 17, 40, 90], engine.spec.vocab_size, seed=3)
    # Stopping at EOS, as the engine suite does: past an EOS, random prompts leave near-ties in any dtype.
    completions = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0))
    assert [list(c.output_token_ids) for c in completions] == hf_greedy(model_dir, prompts, 20)
    assert engine.block_pool.is_whole()


@pytest.mark.parametrize("kernel", [*KERNELS[:1], pytest.param("onednn-packed", marks=pytest.mark.skipif(
    onednn_unavailable_reason(torch.bfloat16, torch.device("cpu")) is not None, reason="no oneDNN bf16"))])
def test_bfloat16_request_alone_is_token_identical_on_each_kernel(model_dir: Path, kernel: str) -> None:
    # SDPA: bit-identical to transformers in bf16 (the paged kernel, auto's choice on a CPU, is held to vLLM's
    # standard instead: tests/engine/test_compiled_engine.py).
    engine = engine_for(model_dir, "bfloat16", kernel, "sdpa")
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    prompts = random_prompts([7, 33, 100], engine.spec.vocab_size, seed=4)
    expected = hf_greedy(model_dir, prompts, 20, dtype=torch.bfloat16, ignore_eos=True)
    for prompt, tokens in zip(prompts, expected, strict=True):
        [completion] = engine.generate([prompt], GREEDY)
        assert list(completion.output_token_ids) == tokens
    assert engine.block_pool.is_whole()


def test_auto_kernel_probes_and_says_why(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir, "float32", "auto")
    report = engine.linear_kernel
    assert report.requested is LinearKernel.AUTO
    if onednn_unavailable_reason(torch.float32, torch.device("cpu")) is None:
        assert set(report.torch_ms) == {1, 16, 256} and report.speedup is not None and report.speedup >= 1.0
        assert report.reason.startswith("probe of torch, onednn-packed")
    # The lean body's qkv, o, gate_up, down per layer (q/k/v and gate/up fused), and the lm_head.
    assert report.num_linears == 4 * 4 + 1


def test_probe_falls_back_to_torch_without_onednn(tiny_llama_dir: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setattr(linear_kernels, "zentorch_unavailable_reason", lambda *args: "no zentorch either")
    engine = engine_for(tiny_llama_dir, "float32", "auto")
    assert engine.linear_kernel.kernel is LinearKernel.TORCH
    assert "no oneDNN" in engine.linear_kernel.reason
    [completion] = engine.generate(random_prompts([9], engine.spec.vocab_size), GREEDY)
    assert len(completion.output_token_ids) == 20
    with pytest.raises(ValueError, match="linear kernel 'onednn-packed': this torch build has no oneDNN"):
        engine_for(tiny_llama_dir, "float32", "onednn-packed")


def test_probe_that_fails_keeps_torch(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("could not create a primitive")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken)
    monkeypatch.setattr(linear_kernels, "zentorch_unavailable_reason", lambda *args: "no zentorch either")
    engine = engine_for(tiny_llama_dir, "float32", "auto")
    assert engine.linear_kernel.kernel is LinearKernel.TORCH
    assert "probe failed: could not create a primitive" in engine.linear_kernel.reason
    assert not any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())


def test_zentorch_is_left_out_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    amd, avx2 = "AuthenticAMD", frozenset({"avx2", "fma"})
    assert "for AMD CPUs" in str(zentorch_unavailable_reason(torch.float32, CPU, avx2, "GenuineIntel"))
    assert "needs AVX512_BF16" in str(zentorch_unavailable_reason(torch.bfloat16, CPU, avx2, amd))
    assert "CPU kernel" in str(zentorch_unavailable_reason(torch.float32, torch.device("cuda"), avx2, amd))
    monkeypatch.setitem(__import__("sys").modules, "zentorch", None)  # as if not installed: import fails
    reason = str(zentorch_unavailable_reason(torch.float32, CPU, avx2, amd))
    assert "zentorch is not installed (pip install 'pdserve[zen]')" in reason


def test_a_machine_without_zentorch_probes_the_others(tiny_llama_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "zentorch", None)
    monkeypatch.setattr(linear_kernels, "cpu_vendor", lambda: "AuthenticAMD")
    engine = engine_for(tiny_llama_dir, "float32", "auto")
    report = engine.linear_kernel
    assert LinearKernel.ZENTORCH not in report.kernels_in_use
    assert "zentorch is not installed" in report.reason
    with pytest.raises(ValueError, match="linear kernel 'zentorch': zentorch is not installed"):
        engine_for(tiny_llama_dir, "float32", "zentorch")


@pytest.mark.skipif(zentorch_unavailable_reason(torch.float32, CPU) is not None, reason="no zentorch here")
def test_the_probe_weighs_zentorch_beside_onednn(tiny_llama_dir: Path) -> None:
    engine = engine_for(tiny_llama_dir, "float32", "auto")
    report = engine.linear_kernel
    assert "zentorch" in report.reason  # timed: each shape's winner per band is listed
    bands = [m.bands for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
    assert set(report.kernels_in_use) == {k for b in bands for k in b} | (
        {LinearKernel.TORCH} if len(bands) < report.num_linears else set())
    assert report.label == "+".join(k.value for k in report.kernels_in_use if k is not LinearKernel.TORCH) \
        or report.label == "torch"


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx2", "avx512f", "avx512_bf16"}, "bfloat16"),  # AMD EPYC Genoa-class, Intel Cooper Lake
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, "bfloat16"),  # Intel Sapphire Rapids
    ({"avx2", "fma"}, "float32"),  # AMD with AVX2 only: bf16 is emulated there, no faster
    ({"avx2", "avx512f"}, "float32"),
    (set(), "float32"),
])
def test_auto_dtype_follows_the_cpu_flags(flags: set[str], expected: str) -> None:
    assert resolve_dtype("auto", "cpu", frozenset(flags)) == expected
    assert resolve_dtype("float32", "cpu", frozenset(flags)) == "float32"


def test_dtype_choices_on_cuda_and_errors() -> None:
    assert resolve_dtype("float16", "cuda") == "float16"
    assert resolve_dtype("auto", "cuda:1") in ("bfloat16", "float16")
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16, got 'int8'"):
        resolve_dtype("int8", "cpu")


def test_the_kv_cache_follows_the_dtype(tiny_llama_dir: Path) -> None:
    spec = read_model_spec(tiny_llama_dir)
    per_dtype = {d: KVCacheSpec.from_model(spec, EngineConfig(str(tiny_llama_dir), dtype=d)).bytes_per_token
                 for d in ("float32", "bfloat16")}
    assert per_dtype["bfloat16"] * 2 == per_dtype["float32"]
    assert EngineConfig(str(tiny_llama_dir)).dtype in ("float32", "bfloat16")  # "auto" resolved at once


@pytest.mark.parametrize(("allowed", "slot", "threads", "expected"), [
    ([0, 1], 0, 1, (0,)), ([0, 1], 1, 1, (1,)),
    ([0, 1], 2, 1, (0,)),  # a third worker on 2 cores shares the first one's core
    ([0, 1], 1, 2, (0, 1)),  # two threads each on 2 cores: both share both
    ([0, 1, 2, 3], 1, 2, (2, 3)),
    ([4, 6], 1, 1, (6,)),  # the cores the process may use, not 0..n
])
def test_a_worker_slot_maps_to_its_own_cores(allowed: list[int], slot: int, threads: int,
                                             expected: tuple[int, ...]) -> None:
    assert cores_for_slot(slot, threads, allowed) == expected
