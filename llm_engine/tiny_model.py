"""Small real models, built on the spot: fast tests and benchmarks use them where SmolLM2 would be slow.

One per supported family (llm_engine/config.py SUPPORTED_ARCHITECTURES), each from transformers' own config
class with the family's own parts (Qwen3's q/k norms, Gemma's scaled embeddings and head_dim, Phi-3's fused
projections, Qwen2's q/k/v biases) and random weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Family → (transformers model_type, what its tiny config sets beyond the common shape).
TINY_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {"sliding_window": None}),  # a window is tested on its own (test_model_families)
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 48}),  # its own head_dim, not hidden / heads
    "gemma": ("gemma", {"head_dim": 48}),
    "phi3": ("phi3", {}),
}


def build_tiny_model(family: str, out_dir: Path, *, vocab_size: int = 1000, seed: int = 0,
                     **overrides: Any) -> Path:
    """A 4-layer random model of `family` (hidden 256, GQA 8/2 heads) saved as a Hugging Face directory.

    Args:
        overrides: config fields beyond the family's (e.g. sliding_window=64).

    Raises:
        ValueError: an unknown family; the message lists the known ones.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    model_type, own = TINY_FAMILIES[family]
    shape: dict[str, Any] = {
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 1024,
        # A wide init makes logits peaked, so greedy ties (where float noise could pick either) are rare.
        "initializer_range": 0.2,
        # No special tokens: outputs run to max_tokens, and no family default points past a tiny vocabulary.
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **{**shape, **own, **overrides})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    return out_dir


def build_tiny_llama(out_dir: Path, *, vocab_size: int = 1000, seed: int = 0) -> Path:
    """A 4-layer random Llama (hidden 256, GQA 8/2 heads) saved as a Hugging Face directory."""
    return build_tiny_model("llama", out_dir, vocab_size=vocab_size, seed=seed)
