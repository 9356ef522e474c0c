"""A lean-family model built straight from its checkpoint: config.json (llm_engine/checkpoint_config.py) and
the safetensors files, no transformers import.

    load_lean_model(config, model_dir, dtype, device, max_positions, share) → LeanCausalLM (lean_body,
        lm_head)
The tensors are those transformers' from_pretrained would put in its modules (the same names, cast to the
same dtype), the rotary table the one its rotary module computes for plain rope; the worker's model load
then costs what reading the weights costs, and its process skips ~3.4 CPU-seconds of imports.
Each tensor is read when its module is built, and a rank of a tensor-parallel worker (`share`) reads only
its rows or columns of each layer's projections (safetensors reads a slice without the rest), so a rank
never holds more than its share of the layers, on the device or off it: what lets a model larger than one
device load over several; the same for the lm_head, split over the ranks by vocabulary rows.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llm_engine.checkpoint_config import SAFETENSORS_FILE, SAFETENSORS_INDEX, LeanConfig
from llm_engine.lean_model import LayerWeights, LeanBody, LeanLayer, linear_from
from llm_engine.quantized_linear import QuantizedWeight
from llm_engine.rank_shares import RankShare, vocab_rows


class LeanCausalLM(nn.Module):
    """What the runner needs of a causal LM with a lean body: the body and the lm_head."""

    def __init__(self, lean_body: LeanBody, lm_head: nn.Module) -> None:
        super().__init__()
        self.lean_body = lean_body
        self.lm_head = lm_head


def tensor_files(model_dir: Path) -> list[Path]:
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        return sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    return [model_dir / SAFETENSORS_FILE]


class _Checkpoint:
    """The checkpoint's tensors by name, each read once, whole or a slice of it, when it is taken."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, device: torch.device, files: ExitStack) -> None:
        from safetensors import safe_open

        self._model_dir, self.dtype, self._device = model_dir, dtype, device
        self._handles: dict[str, Any] = {}
        for path in tensor_files(model_dir):
            handle = files.enter_context(safe_open(str(path), framework="pt"))
            self._handles.update(dict.fromkeys(handle.keys(), handle))

    def take(self, name: str, rows: slice | None = None, columns: slice | None = None, *, cast: bool = True
             ) -> torch.Tensor:
        """The tensor, or its rows / columns only (read from the file as such), on the device, cast to the
        model's dtype unless `cast` is False (a quantized layer's integers and scales).

        Raises:
            ValueError: the checkpoint has no such tensor, or it was taken already.
        """
        if name not in self._handles:
            raise ValueError(f"{self._model_dir}: the checkpoint has no tensor {name!r}")
        handle = self._handles.pop(name)
        if rows is None and columns is None:
            tensor = handle.get_tensor(name)
        else:
            view = handle.get_slice(name)
            every = slice(None)
            tensor = view[rows or every] if columns is None else view[rows or every, columns]
        return tensor.to(device=self._device, dtype=self.dtype if cast else tensor.dtype)


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
                    max_positions: int, share: RankShare | None = None, rank: int = 0, size: int = 1
                    ) -> LeanCausalLM:
    """The model's weights in `dtype` on `device`, as a lean body and an lm_head; with `share`, rank `rank`'s
    slice of every layer (q/k/v and gate/up rows, o and down columns: llm_engine/rank_shares.py), the
    layers' head counts set to it, and its rows of the lm_head (of `size` ranks).

    Raises:
        ValueError: the checkpoint lacks a tensor the config calls for (the message names it).
    """
    with ExitStack() as files:
        checkpoint = _Checkpoint(Path(model_dir), dtype, device, files)
        return _build(config, checkpoint, max_positions, share, rank, size)


def _build(config: LeanConfig, checkpoint: _Checkpoint, max_positions: int, share: RankShare | None,
           rank: int, size: int) -> LeanCausalLM:
    take, dim = checkpoint.take, config.head_dim
    # None: the whole tensor (one rank)
    q_rows, kv_rows = (share.q_rows(dim), share.kv_rows(dim)) if share else (None, None)
    mlp_rows = share.mlp_rows if share else None

    scheme = config.weight_scheme

    def linear(prefix: str, bias: bool = False, rows: slice | None = None, columns: slice | None = None
               ) -> nn.Linear | QuantizedWeight:
        quant = scheme.layer(prefix) if scheme is not None else None
        if quant is None:
            weight = take(f"{prefix}.weight", rows, columns)
            return linear_from(weight, take(f"{prefix}.bias", rows) if bias else None)
        # Integers and scales as stored, read whole: a rank's share is cut from the unpacked values.
        quantized = QuantizedWeight.read(partial(take, cast=False), prefix, quant, checkpoint.dtype,
                                         take(f"{prefix}.bias") if bias else None)
        quantized = quantized if rows is None else quantized.rows(rows)
        return quantized if columns is None else quantized.columns(columns)

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(take(name), requires_grad=False)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        weights = LayerWeights(
            q_proj=linear(f"{p}.self_attn.q_proj", config.qkv_bias, q_rows),
            k_proj=linear(f"{p}.self_attn.k_proj", config.qkv_bias, kv_rows),
            v_proj=linear(f"{p}.self_attn.v_proj", config.qkv_bias, kv_rows),
            # Row-parallel: each rank's input columns (the families here have no o/down bias to add once)
            o_proj=linear(f"{p}.self_attn.o_proj", columns=q_rows),
            gate_proj=linear(f"{p}.mlp.gate_proj", rows=mlp_rows),
            up_proj=linear(f"{p}.mlp.up_proj", rows=mlp_rows),
            down_proj=linear(f"{p}.mlp.down_proj", columns=mlp_rows),
            input_norm=norm(f"{p}.input_layernorm.weight"),
            post_attention_norm=norm(f"{p}.post_attention_layernorm.weight"),
            eps=config.rms_norm_eps,
            q_norm=norm(f"{p}.self_attn.q_norm.weight") if config.qk_norm else None,
            k_norm=norm(f"{p}.self_attn.k_norm.weight") if config.qk_norm else None,
        )
        num_heads, num_kv_heads = (share.num_heads, share.num_kv_heads) if share else (config.num_heads,
                                                                                   config.num_kv_heads)
        layers.append(LeanLayer(weights, i, num_heads, num_kv_heads, dim))
    # from_pretrained: no init of a weight about to be replaced (on the meta device, that init alone would
    # import torch's dynamo through its reference ops: half a CPU-second of a worker's start)
    embedding = nn.Embedding.from_pretrained(take("model.embed_tokens.weight"), freeze=True)
    # Tied: one tensor, as transformers ties them (a checkpoint may still carry a copy of it). Tensor
    # parallel: this rank's rows of the vocabulary (llm_engine/tp_sharding.py VocabParallelHead).
    if share is not None and size < 2:
        raise ValueError(f"rank {rank}'s share of a tensor-parallel model needs the number of ranks, got "
                         f"{size}")
    vocab = vocab_rows(config.vocab_size, size, rank) if share else None
    lm_head = (linear_from(embedding.weight if vocab is None else embedding.weight[vocab])
               if config.tie_word_embeddings else linear_from(take("lm_head.weight", vocab)))
    cos, sin = rotary_table(config, max_positions, embedding.weight.dtype, embedding.weight.device)
    body = LeanBody(embedding, layers, norm("model.norm.weight"), config.rms_norm_eps, cos, sin)
    return LeanCausalLM(body, lm_head)
