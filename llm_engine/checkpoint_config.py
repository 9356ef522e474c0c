"""A Llama-family checkpoint's shape read from its config.json alone, without transformers.

    read_lean_config(model_dir) → LeanConfig, or the reason transformers must read this model (a str)
Why: importing transformers' config or model classes costs a worker process ~3.4 CPU-seconds (its import
pulls torch.distributed.tensor, sympy, accelerate and dynamo), more than torch itself; a worker that loads a
lean family (llm_engine/lean_model.py) from this and the safetensors files starts in about half the CPU.
Only what transformers would read the same way is taken: every shape field explicit in the file, the
family defaults that do not differ between the families (silu, untied embeddings, no attention bias but
Qwen2's q/k/v), plain rotary (rope type "default"). Anything else (a rope scaling, a sliding window the
layers mix, biases on o_proj or the MLP, .bin weights) goes through transformers' own
reading and model (llm_engine/model_loader.py); tests/engine/test_checkpoint_config.py holds this reading
to transformers' on every family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_engine.weight_schemes import WeightScheme, read_weight_scheme

LEAN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Fields every family's config class has no family-independent default for: the file must name them.
_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps")


@dataclass(frozen=True)
class LeanConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: q/k/v carry a bias (o_proj and the MLP none)
    qk_norm: bool  # Qwen3: an RMSNorm over each head's q and k
    sliding_window: int | None  # Mistral's window over every layer; None: full attention
    # compressed-tensors integer weights (llm_engine/weight_schemes.py); None: the weights as they are
    weight_scheme: WeightScheme | None = None


def _rope_theta(raw: dict[str, Any]) -> float | str:
    """The rotary base of plain (unscaled) rope, or why this is not plain rope."""
    rope = raw.get("rope_parameters")
    if isinstance(rope, dict):
        if rope.get("rope_type", "default") != "default" or rope.get("partial_rotary_factor", 1.0) != 1.0:
            return f"rope type {rope.get('rope_type')!r}"
        theta = rope.get("rope_theta")
    else:  # the layout before transformers 5: rope_theta beside rope_scaling
        if raw.get("rope_scaling"):
            return f"rope scaling {raw['rope_scaling']!r}"
        theta = raw.get("rope_theta")
    return float(theta) if isinstance(theta, (int, float)) else "no rope_theta"


def _sliding_window(raw: dict[str, Any], architecture: str) -> int | str | None:
    layer_types = raw.get("layer_types")
    if layer_types and any(kind != "full_attention" for kind in layer_types):
        return "layers of mixed attention"
    if architecture == "MistralForCausalLM":
        if "sliding_window" not in raw:  # MistralConfig's default is a 4096 window
            return "no sliding_window named"
        window = raw["sliding_window"]
        return int(window) if window else None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        return "use_sliding_window"
    return None


def _weights_present(path: Path) -> bool:
    return (path / SAFETENSORS_FILE).is_file() or (path / SAFETENSORS_INDEX).is_file()


def read_lean_config(model_dir: str | Path) -> LeanConfig | str:
    """The lean family's shape from `model_dir`'s config.json, or why transformers must read it.

    Raises:
        UnsupportedQuantization: its quantization_config is one pdserve does not serve.
    """
    path = Path(model_dir)
    raw = json.loads((path / "config.json").read_text())
    architecture = next(iter(raw.get("architectures") or []), None)
    if architecture not in LEAN_ARCHITECTURES:
        return f"architecture {architecture!r} has no lean body"
    missing = [name for name in _REQUIRED if raw.get(name) is None]
    if missing:
        return f"config.json does not name {', '.join(missing)}"
    if raw.get("hidden_act", "silu") != "silu":
        return f"activation {raw['hidden_act']!r}"
    if raw.get("mlp_bias") or (architecture != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        return "biases beyond Qwen2's q/k/v"
    if not _weights_present(path):
        return "no safetensors weights"
    theta = _rope_theta(raw)
    window = _sliding_window(raw, architecture)
    if isinstance(theta, str) or isinstance(window, str):
        return str(theta if isinstance(theta, str) else window)
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if architecture == "Qwen3ForCausalLM":  # Qwen3Config's default is 128, not hidden / heads
            return "no head_dim named"
        head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    return LeanConfig(
        architecture=architecture,
        num_layers=int(raw["num_hidden_layers"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_heads=int(raw["num_attention_heads"]),
        num_kv_heads=int(raw["num_key_value_heads"]),
        head_dim=int(head_dim),
        vocab_size=int(raw["vocab_size"]),
        max_position_embeddings=int(raw["max_position_embeddings"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_theta=theta,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=architecture == "Qwen2ForCausalLM",
        qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_window=window,
        weight_scheme=read_weight_scheme(raw),
    )
