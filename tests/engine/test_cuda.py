"""The engine on a CUDA device: same greedy tokens as transformers (skips without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers.reference import random_prompts

pytestmark = pytest.mark.gpu


def test_greedy_matches_transformers_on_cuda(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompts = random_prompts([5, 40, 130], 1000)
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32",
                                    device="cuda", kv_cache_bytes=16 << 20,
                                    max_num_batched_tokens=64))
    assert engine.runner.kv_cache.is_cuda
    completions = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0))
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).cuda().eval()
    for prompt, completion in zip(prompts, completions, strict=True):
        ids = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16, do_sample=False)
        assert list(completion.output_token_ids) == ids[0, len(prompt):].tolist()
    assert engine.block_pool.is_whole()


def test_gpu_memory_utilization_sizes_the_kv_cache_from_the_gpu(tiny_llama_dir: Path) -> None:
    """--gpu-memory-utilization: the KV cache is what the share leaves after weights and activations
    (llm_engine/kv_sizing.py), measured on the real device, and the engine serves with it."""
    from llm_engine.kv_sizing import NON_TORCH_BYTES

    _, total = torch.cuda.mem_get_info()
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", device="cuda",
                                    gpu_memory_utilization=0.3, max_num_batched_tokens=64))
    capacity = engine.kv_capacity
    assert 0 < capacity.num_bytes <= 0.3 * total - NON_TORCH_BYTES
    assert engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size() == capacity.num_bytes
    assert "GPU memory" in capacity.source
    [done] = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(done.output_token_ids) == 4
