"""The CUDA attention path's packing (llm_engine/varlen_attention.py), checked on a CPU.

varlen_attn is a CUDA kernel, so here the engine's InputBatch is handed a plain-torch function with its
documented semantics (one sequence per chunk, causal aligned bottom-right, grouped KV heads): what is under
test is ours — each chunk's keys gathered from its block table, the cumulative lengths, the packed order —
through chunked prefills, prefix hits and decodes, ending in transformers' float32 greedy tokens. The kernel
itself runs in the GPU check (benchmarks/gpu_check.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.varlen_attention import varlen_fits
from tests.helpers.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def varlen_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
                     cu_seq_k: torch.Tensor, max_q: int, max_k: int, *, scale: float | None,
                     window_size: tuple[int, int], enable_gqa: bool) -> torch.Tensor:
    """varlen_attn's semantics in plain torch: query [Tq, H, D], key/value [Tk, KVH, D] → [Tq, H, D]."""
    assert window_size == (-1, 0) and enable_gqa
    out = torch.empty_like(query)
    bounds = zip(cu_seq_q.tolist(), cu_seq_q[1:].tolist(), cu_seq_k.tolist(), cu_seq_k[1:].tolist(),
                 strict=False)
    for q_start, q_end, k_start, k_end in bounds:
        num_q, num_k = q_end - q_start, k_end - k_start
        assert num_q <= max_q and num_k <= max_k
        # Bottom-right causal: the chunk's query i stands at position num_k - num_q + i of its context.
        visible = torch.arange(num_k)[None] <= torch.arange(num_k - num_q, num_k)[:, None]  # [num_q, num_k]
        attn = F.scaled_dot_product_attention(
            query[q_start:q_end].transpose(0, 1)[None], key[k_start:k_end].transpose(0, 1)[None],
            value[k_start:k_end].transpose(0, 1)[None], attn_mask=visible, scale=scale, enable_gqa=True)
        out[q_start:q_end] = attn[0].transpose(0, 1)
    return out


def test_the_varlen_packing_gives_transformers_greedy_tokens(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=8 << 20,
                                    max_num_batched_tokens=24, compile="off"))
    calls: list[int] = []

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return varlen_reference(*args, **kwargs)  # type: ignore[arg-type]

    engine.runner.inputs.varlen_kernel = counted
    prompts = random_prompts([5, 40, 19, 1], 1000, seed=7)
    # The 24-token budget prefills the 40-token prompt in two chunks while the others decode.
    outputs = [list(c.output_token_ids) for c in engine.generate(prompts, GREEDY)]
    assert outputs == hf_greedy(tiny_llama_dir, prompts, 8, ignore_eos=True)
    assert calls  # every layer of every forward went through it
    # Prefix hits: the rest of each prompt prefilled over cached blocks, in the same batch as a fresh one.
    shared = [[*prompts[1], 7, 8, 9], [*prompts[1][:32], 3], random_prompts([9], 1000, seed=8)[0]]
    outputs = [list(c.output_token_ids) for c in engine.generate(shared, GREEDY)]
    assert outputs == hf_greedy(tiny_llama_dir, shared, 8, ignore_eos=True)
    assert engine.block_pool.is_whole()


def test_varlen_serves_only_what_flashattention_computes() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert varlen_fits(cuda, torch.bfloat16, 64) is None
    assert varlen_fits(cuda, torch.float16, 128) is None
    assert "float16/bfloat16" in str(varlen_fits(cuda, torch.float32, 64))
    assert "CUDA" in str(varlen_fits(cpu, torch.bfloat16, 64))
    assert "head dims" in str(varlen_fits(cuda, torch.bfloat16, 320))
