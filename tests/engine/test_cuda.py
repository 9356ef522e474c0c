"""The engine on a CUDA device: same greedy tokens as transformers (skips without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.conftest import random_prompts

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
