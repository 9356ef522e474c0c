"""A small real model, built on the spot: fast tests and benchmarks use it where SmolLM2 would be slow."""

from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_llama(out_dir: Path, *, vocab_size: int = 1000, seed: int = 0) -> Path:
    """A 4-layer random Llama (hidden 256, GQA 8/2 heads) saved as a Hugging Face directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # A wide init makes logits peaked, so greedy ties (where float noise could pick either) are rare.
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir
