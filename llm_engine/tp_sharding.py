"""How a tensor-parallel rank's slice of the model is cut and joined to its group
(llm_engine/tensor_parallel.py says what each rank holds and why): Megatron-style rows and columns of each
layer's projections, and the lm_head's rows of the vocabulary.

    a body loaded whole (transformers' modules): shard_lean_body → this rank's rows / columns of each layer
    a body loaded as this rank's slice (llm_engine/lean_loader.py): join_group
    either: vocab_parallel_head → the lm_head's rows of this rank, its logits gathered on rank 0
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from llm_engine.rank_shares import rank_shares, vocab_rows
from llm_engine.tensor_parallel import TPGroup

if TYPE_CHECKING:
    from llm_engine.lean_model import LeanBody, LeanLayer


def _column_rows(weight: torch.Tensor | None, parts: list[tuple[int, slice]]) -> torch.Tensor | None:
    """A rank's rows of a fused column-parallel weight (or bias): of each part (its rows, the rank's rows of
    it), the rank's rows, side by side."""
    if weight is None:
        return None
    pieces, start = [], 0
    for rows, mine in parts:
        pieces.append(weight[start:start + rows][mine])
        start += rows
    return torch.cat(pieces).contiguous()


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                      dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer


def _shard_layer(layer: LeanLayer, group: TPGroup) -> None:
    share = rank_shares(layer.num_heads, layer.num_kv_heads, layer.intermediate, group.size)[group.rank]
    q_rows, kv_rows = share.q_rows(layer.head_dim), share.kv_rows(layer.head_dim)
    qkv: nn.Linear = layer.qkv_proj  # type: ignore[assignment]  # sharded before the kernel probe
    parts = [(layer.q_size, q_rows), (layer.kv_size, kv_rows), (layer.kv_size, kv_rows)]
    layer.qkv_proj = _linear(_column_rows(qkv.weight, parts),  # type: ignore[arg-type]
                             _column_rows(qkv.bias, parts))
    gate_up: nn.Linear = layer.gate_up_proj  # type: ignore[assignment]
    parts = [(layer.intermediate, share.mlp_rows), (layer.intermediate, share.mlp_rows)]
    layer.gate_up_proj = _linear(_column_rows(gate_up.weight, parts),  # type: ignore[arg-type]
                                 _column_rows(gate_up.bias, parts))
    # Row-parallel: each rank's input columns; a bias is added once, by rank 0, before the sum.
    for name, columns in (("o_proj", q_rows), ("down_proj", share.mlp_rows)):
        full: nn.Linear = getattr(layer, name)
        bias = full.bias if group.rank == 0 else None
        setattr(layer, name, _linear(full.weight[:, columns].contiguous(), bias))
    layer.num_heads, layer.num_kv_heads = share.num_heads, share.num_kv_heads
    layer.q_size, layer.kv_size = share.num_heads * layer.head_dim, share.num_kv_heads * layer.head_dim
    layer.intermediate = share.mlp_width


class VocabParallelHead(nn.Module):
    """This rank's rows of the lm_head: every rank projects the same hidden rows onto its share of the
    vocabulary, and rank 0 gathers the shares into whole logits (the other ranks get None). Every call is a
    collective: a rank > 0 makes the calls rank 0 makes, in its order (ModelRunner.replay)."""

    def __init__(self, linear: nn.Linear, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.linear = linear  # an attribute the linear-kernel probe finds and may swap
        self.group = group
        rows = [vocab_rows(vocab_size, group.size, r) for r in range(group.size)]
        self.widths = [r.stop - r.start for r in rows]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        part = self.linear(hidden)  # [rows, this rank's vocabulary]
        widest = self.widths[0]
        if part.shape[-1] < widest:  # the collectives move tensors of one shape
            part = torch.cat([part, part.new_zeros((*part.shape[:-1], widest - part.shape[-1]))], dim=-1)
        parts = self.group.gather_to_first(part)
        if self.group.rank != 0:
            return None
        return torch.cat([p[..., :width] for p, width in zip(parts, self.widths, strict=True)], dim=-1)


def vocab_parallel_head(model: nn.Module, vocab_size: int, group: TPGroup, whole: bool) -> None:
    """Put a VocabParallelHead in place of `model.lm_head`: over the head as loaded (this rank's rows), or
    over this rank's rows of it when it was loaded `whole` (transformers' modules)."""
    head: nn.Linear = model.get_submodule("lm_head")  # type: ignore[assignment]
    if whole:
        vocab_size = head.weight.shape[0]
        head = _linear(head.weight[vocab_rows(vocab_size, group.size, group.rank)].contiguous(), None)
    model.lm_head = VocabParallelHead(head, vocab_size, group)


def shard_lean_body(body: LeanBody, group: TPGroup) -> None:
    """Keep this rank's slice of every layer of a body loaded whole (in place; transformers' modules, which
    a few checkpoints need: llm_engine/model_loader.py), and join the group."""
    for layer in body.layers:
        _shard_layer(layer, group)  # type: ignore[arg-type]
    join_group(body, group)


def join_group(body: LeanBody, group: TPGroup) -> None:
    """The layers of a body that holds this rank's slice sum their row-parallel outputs over the group."""
    for layer in body.layers:
        layer.tp_handle = group.handle  # type: ignore[assignment]
