"""A lean-family model built straight from its checkpoint: config.json (llm_engine/checkpoint_config.py) and
the safetensors files, no transformers import.

    load_lean_model(config, model_dir, dtype, device, max_positions) → LeanCausalLM (lean_body, lm_head)
The tensors are those transformers' from_pretrained would put in its modules (the same names, cast to the
same dtype), the rotary table the one its rotary module computes for plain rope; the worker's model load
then costs what reading the weights costs, and its process skips ~3.4 CPU-seconds of imports.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from llm_engine.checkpoint_config import SAFETENSORS_FILE, SAFETENSORS_INDEX, LeanConfig
from llm_engine.lean_model import LayerWeights, LeanBody, LeanLayer, linear_from


class LeanCausalLM(nn.Module):
    """What the runner needs of a causal LM with a lean body: the body and the lm_head."""

    def __init__(self, lean_body: LeanBody, lm_head: nn.Linear) -> None:
        super().__init__()
        self.lean_body = lean_body
        self.lm_head = lm_head


def _tensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    return [model_dir / SAFETENSORS_FILE]


def _read_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in _tensor_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (a safe_open handle is not iterable)
                yield name, f.get_tensor(name)


def rotary_table(config: LeanConfig, max_positions: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, head_dim] as transformers' rotary module gives them for plain rope: the
    inverse frequencies and the angles in float32, then cast to the model's dtype."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    positions = torch.arange(max_positions, device=device)
    freqs = positions[:, None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def load_lean_model(config: LeanConfig, model_dir: str | Path, dtype: torch.dtype, device: torch.device,
                    max_positions: int) -> LeanCausalLM:
    """The model's weights in `dtype` on `device`, as a lean body and an lm_head.

    Raises:
        ValueError: the checkpoint lacks a tensor the config calls for (the message names it).
    """
    tensors = {name: t.to(device=device, dtype=dtype) for name, t in _read_tensors(Path(model_dir))}

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"{model_dir}: the checkpoint has no tensor {name!r}")
        return tensors.pop(name)

    def linear(prefix: str, bias: bool = False) -> nn.Linear:
        return linear_from(take(f"{prefix}.weight"), take(f"{prefix}.bias") if bias else None)

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(take(name), requires_grad=False)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        weights = LayerWeights(
            q_proj=linear(f"{p}.self_attn.q_proj", config.qkv_bias),
            k_proj=linear(f"{p}.self_attn.k_proj", config.qkv_bias),
            v_proj=linear(f"{p}.self_attn.v_proj", config.qkv_bias),
            o_proj=linear(f"{p}.self_attn.o_proj"),
            gate_proj=linear(f"{p}.mlp.gate_proj"), up_proj=linear(f"{p}.mlp.up_proj"),
            down_proj=linear(f"{p}.mlp.down_proj"),
            input_norm=norm(f"{p}.input_layernorm.weight"),
            post_attention_norm=norm(f"{p}.post_attention_layernorm.weight"),
            eps=config.rms_norm_eps,
            q_norm=norm(f"{p}.self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=norm(f"{p}.self_attn.k_norm.weight") if config.qk_norm else None,
        )
        layers.append(LeanLayer(weights, i, config.num_heads, config.num_kv_heads, config.head_dim))
    # from_pretrained: no init of a weight about to be replaced (on the meta device, that init alone would
    # import torch's dynamo through its reference ops: half a CPU-second of a worker's start)
    embedding = nn.Embedding.from_pretrained(take("model.embed_tokens.weight"), freeze=True)
    # Tied: one tensor, as transformers ties them (a checkpoint may still carry a copy of it).
    lm_head = linear_from(embedding.weight if config.tie_word_embeddings else take("lm_head.weight"))
    cos, sin = rotary_table(config, max_positions, dtype, device)
    body = LeanBody(embedding, layers, norm("model.norm.weight"), config.rms_norm_eps, cos, sin)
    return LeanCausalLM(body, lm_head)
