"""Every supported family, as a tiny random model from transformers' own config class, gives transformers'
greedy tokens through the engine (prompts prefilled in chunks beside decodes); and what the paged attention
cannot compute (sliding windows past the window, rotary scaling that depends on the batch, soft-capped
families) is refused, never served wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.config import SUPPORTED_ARCHITECTURES
from llm_engine.model_files import read_model_spec
from llm_engine.tiny_model import TINY_FAMILIES, build_tiny_model
from tests.helpers.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def engine_for(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {"dtype": "float32", "kv_cache_bytes": 8 << 20, **overrides}
    return LLMEngine(EngineConfig(str(model_dir), **settings))  # type: ignore[arg-type]


def test_every_supported_architecture_has_a_tiny_family() -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    built = {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type] for model_type, _ in TINY_FAMILIES.values()}
    assert built == set(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_family_greedy_tokens_equal_transformers(family: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    prompts = random_prompts([5, 40, 19, 1], 1000)
    # A 24-token budget prefills the 40-token prompt in two chunks while the others decode.
    engine = engine_for(model_dir, max_num_batched_tokens=24)
    completions = engine.generate(prompts, GREEDY)
    assert [list(c.output_token_ids) for c in completions] == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert engine.block_pool.is_whole()


def test_a_sliding_window_caps_the_context_and_tokens_within_it_are_exact(tmp_path: Path) -> None:
    model_dir = build_tiny_model("mistral", tmp_path / "mistral", sliding_window=48)
    assert read_model_spec(model_dir).max_model_len == 48
    engine = engine_for(model_dir)
    prompts = random_prompts([30, 40], 1000)
    completions = engine.generate(prompts, GREEDY)  # 40 + 8 = 48: the whole window, not past it
    assert [list(c.output_token_ids) for c in completions] == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    with pytest.raises(ValueError, match="context length of 48 tokens"):
        engine.generate(random_prompts([41], 1000), GREEDY)
    assert engine.block_pool.is_whole()


def test_a_window_the_config_turns_off_does_not_cap(tmp_path: Path) -> None:
    # Qwen2 and Qwen3 name a window but slide only with use_sliding_window (as transformers reads them).
    model_dir = build_tiny_model("qwen3", tmp_path / "qwen3", sliding_window=48, use_sliding_window=False)
    assert read_model_spec(model_dir).max_model_len == 1024


def test_rotary_scaling_that_depends_on_the_batch_caps_the_context(tmp_path: Path) -> None:
    # Phi-3's longrope switches frequencies when the longest position in a forward passes the original
    # length: in a packed batch one request would change another's tokens, so the context stops there.
    half = 32 // 2  # head_dim 32
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * half,
            "long_factor": [4.0] * half}
    model_dir = build_tiny_model("phi3", tmp_path / "phi3", rope_parameters=rope,
                                 original_max_position_embeddings=256)
    assert read_model_spec(model_dir).max_model_len == 256
    prompts = random_prompts([20, 3], 1000)
    completions = engine_for(model_dir).generate(prompts, GREEDY)
    assert [list(c.output_token_ids) for c in completions] == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_a_soft_capped_family_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, architectures=["Gemma2ForCausalLM"]
                 ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported architecture.*Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        read_model_spec(tmp_path)
