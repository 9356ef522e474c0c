"""pdserve's C++ paged decode attention against gather + SDPA; the engine's fallback when it cannot build."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llm_engine import EngineConfig, LLMEngine, SamplingParams, native_kernels
from llm_engine.model_runner import choose_decode_attention
from tests.helpers.reference import random_prompts

kernel = native_kernels.paged_decode_attention()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the C++ kernel does not build here")


def reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
              lengths: list[int], scale: float) -> torch.Tensor:
    """Each sequence alone: its blocks gathered, cut to its length, SDPA with GQA. [B, H, D]."""
    outputs = []
    for row, length in enumerate(lengths):
        k = keys[tables[row]].flatten(0, 1)[:length].transpose(0, 1)[None]  # [1, KVH, L, D]
        v = values[tables[row]].flatten(0, 1)[:length].transpose(0, 1)[None]
        q = query[row][None, :, None]  # [1, H, 1, D]
        outputs.append(F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale,
                                                      enable_gqa=True)[0, :, 0])
    return torch.stack(outputs)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 32), (4, 4, 128)])
def test_kernel_matches_sdpa_over_scattered_blocks(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                                   head_dim: int) -> None:
    generator = torch.Generator().manual_seed(0)
    block_size, num_layers, num_blocks = 16, 3, 128
    cache = torch.randn(num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim,
                        generator=generator).to(dtype)
    lengths = [1, 15, 16, 17, 100, 255]  # inside one block, at its edge, across many
    max_blocks = -(-max(lengths) // block_size)
    # Every row's table: distinct blocks in a scattered order; columns past a row's length hold any block.
    order = torch.randperm(num_blocks, generator=generator)
    tables = order[: len(lengths) * max_blocks].view(len(lengths), -1)
    query = torch.randn(len(lengths), num_heads, head_dim, generator=generator).to(dtype)
    keys, values = cache[:, 1, 0], cache[:, 1, 1]  # layer 1: strided views into the whole cache
    out = kernel(query, keys, values, tables, torch.tensor(lengths), 0.125)
    expected = reference(query, keys, values, tables, lengths, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's last bit (2^-8 relative)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    import torch.utils.cpp_extension

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken)
    native_kernels.paged_decode_attention.cache_clear()
    yield
    native_kernels.paged_decode_attention.cache_clear()


def test_without_a_compiler_the_engine_falls_back_to_sdpa(tiny_llama_dir: Path, no_compiler: None) -> None:
    config = EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=4 << 20)
    assert choose_decode_attention(config) == ("sdpa", None)
    engine = LLMEngine(config)
    [completion] = engine.generate(random_prompts([12], engine.spec.vocab_size),
                                   SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(completion.output_token_ids) == 5 and engine.block_pool.is_whole()
    forced = EngineConfig(str(tiny_llama_dir), dtype="float32", decode_attention="paged-kernel")
    with pytest.raises(RuntimeError, match="'paged-kernel': the kernel did not build here"):
        choose_decode_attention(forced)


def test_bad_decode_attention_values_are_refused() -> None:
    with pytest.raises(ValueError, match="decode_attention must be one of auto, sdpa, paged-kernel"):
        EngineConfig("x", decode_attention="flash")
    with pytest.raises(ValueError, match="'paged-kernel' is a CPU kernel"):
        EngineConfig("x", device="cuda", decode_attention="paged-kernel")


@needs_kernel
def test_auto_decodes_with_the_kernel_on_a_cpu_and_sdpa_where_it_is_not_built(tmp_path: Path,
                                                                             tiny_llama_dir: Path) -> None:
    from llm_engine.model_files import read_model_spec
    from llm_engine.tiny_model import build_tiny_model

    config = EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=4 << 20)
    assert choose_decode_attention(config, read_model_spec(tiny_llama_dir))[0] == "paged-kernel"
    # Qwen3's tiny model has head_dim 48, which the kernel is not built for: auto keeps SDPA, forced refuses.
    qwen3 = build_tiny_model("qwen3", tmp_path / "qwen3")
    spec = read_model_spec(qwen3)
    assert choose_decode_attention(EngineConfig(str(qwen3), dtype="float32"), spec) == ("sdpa", None)
    with pytest.raises(RuntimeError, match="not built for head_dim 48"):
        choose_decode_attention(EngineConfig(str(qwen3), dtype="float32", decode_attention="paged-kernel"),
                                spec)


@needs_kernel
def test_the_kernel_serves_contexts_of_different_lengths_in_one_batch(tiny_llama_dir: Path) -> None:
    # The interference shape: short streams decoding beside a long one, each reading only its own context.
    from tests.helpers.reference import hf_greedy

    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=8 << 20,
                                    decode_attention="paged-kernel"))
    prompts = random_prompts([6, 9, 300, 4], engine.spec.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = [list(c.output_token_ids) for c in engine.generate(prompts, params)]
    assert outputs == hf_greedy(tiny_llama_dir, prompts, 6, ignore_eos=True)
    assert engine.block_pool.is_whole()


def test_a_build_lock_left_by_a_killed_builder_does_not_hang_the_next_start() -> None:
    """torch's build lock is a file whose existence is the lock: a worker killed while it built the kernel
    left it, and every worker after it waited at start for ever (seen in a chaos run). The build runs
    under a flock instead, which a dead process does not hold, and the stale file is cleared under it."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(f"pdserve_paged_attention_{native_kernels._cpu_digest()}",
                                          verbose=False))
    (build_dir / "lock").touch()  # as the killed builder left it
    loaded: list[object] = []
    build = native_kernels.paged_decode_attention.__wrapped__  # past the per-process cache
    loader = threading.Thread(target=lambda: loaded.append(build()), daemon=True)
    loader.start()
    loader.join(600)  # a first build on this machine takes about 6 s
    assert not loader.is_alive(), "the kernel's load waited on the stale lock"
    assert loaded and loaded[0] is not None
    assert not (build_dir / "lock").exists()
