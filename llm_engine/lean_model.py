"""The engine's own model body for the Llama family (Llama, Mistral, Qwen2, Qwen3): the graph
`torch.compile` turns into one program per step.

    built from the checkpoint's files (llm_engine/lean_loader.py: no transformers import in the worker), or
    LeanBody.from_hf(model) from a loaded transformers model (a config only transformers reads right)
    → body(input_ids [T], positions [T]) → final-normed hidden states [T, hidden]
Why its own body and not transformers' modules (as nano-vllm and vLLM keep theirs): a packed batch with flat
[T, ...] tensors and no attention mask, each layer's q/k/v in one GEMM and gate/up in one GEMM, the residual
add folded into the next RMSNorm, rotary from a table built once, and attention as one opaque op
(llm_engine/custom_ops.py): nothing in it breaks a graph. It computes what transformers computes, op for op
in the same order and dtype (RMSNorm in fp32, the weight applied in the model's dtype; cos/sin as its
rotary module computes them), so float32 greedy tokens equal transformers'
(tests/engine/test_compiled_engine.py, tests/engine/test_checkpoint_config.py). Other families keep
transformers' modules, eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llm_engine.checkpoint_config import LEAN_ARCHITECTURES
from llm_engine.custom_ops import paged_attention, tp_all_reduce
from llm_engine.quantized_linear import QuantizedWeight, cat_quantized

if TYPE_CHECKING:
    from transformers import PreTrainedModel



def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, step for step (its rounding, in every dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear over these tensors as they are (no init of weights about to be replaced)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


Projection = nn.Linear | QuantizedWeight  # a layer's weight: as it is, or a checkpoint's integers


def _fused_linear(parts: list[Projection]) -> nn.Module:
    """One layer whose output is the parts' outputs side by side (one GEMM, one weight read)."""
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    if quantized:
        if len(quantized) != len(parts):
            raise ValueError("layers the engine fuses (q/k/v, gate/up) are quantized in part only")
        return cat_quantized(quantized).linear()
    linears = [p for p in parts if isinstance(p, nn.Linear)]
    with torch.no_grad():
        weight = torch.cat([p.weight for p in linears])
        bias = torch.cat([p.bias for p in linears]) if linears[0].bias is not None else None
    return linear_from(weight, bias)


def _as_module(weight: Projection) -> nn.Module:
    return weight.linear() if isinstance(weight, QuantizedWeight) else weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q/k: x [T, heads, D]; cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


@dataclass
class LayerWeights:
    """One decoder layer's weights as the lean layer takes them, from a transformers layer
    (`from_hf_layer`) or straight from a checkpoint (llm_engine/lean_loader.py)."""

    q_proj: Projection
    k_proj: Projection
    v_proj: Projection
    o_proj: Projection
    gate_proj: Projection
    up_proj: Projection
    down_proj: Projection
    input_norm: nn.Parameter
    post_attention_norm: nn.Parameter
    eps: float
    q_norm: nn.Parameter | None = None  # Qwen3
    k_norm: nn.Parameter | None = None
    qk_eps: float | None = None  # None: eps

    @classmethod
    def from_hf_layer(cls, hf_layer: Any) -> LayerWeights:
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return cls(attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj, hf_layer.input_layernorm.weight, hf_layer.post_attention_layernorm.weight,
                   float(hf_layer.input_layernorm.variance_epsilon),
                   None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                   None if q_norm is None else float(q_norm.variance_epsilon))


class LeanLayer(nn.Module):
    qkv_proj: nn.Module  # nn.Linear, or the PackedLinear the kernel probe put in its place
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None

    def __init__(self, weights: LayerWeights, layer_idx: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scaling = head_dim**-0.5  # transformers' attention scaling for these families
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = _fused_linear([weights.q_proj, weights.k_proj, weights.v_proj])
        self.o_proj = _as_module(weights.o_proj)
        self.gate_up_proj = _fused_linear([weights.gate_proj, weights.up_proj])
        self.intermediate = weights.gate_proj.out_features
        self.down_proj = _as_module(weights.down_proj)
        self.input_norm = weights.input_norm
        self.post_attention_norm = weights.post_attention_norm
        self.eps = weights.eps
        # Qwen3: an RMSNorm over each head's q and k before rotary.
        self.q_norm, self.k_norm = weights.q_norm, weights.k_norm
        self.qk_eps = weights.eps if weights.qk_eps is None else weights.qk_eps
        # Tensor parallel: the group whose ranks sum o_proj's and down_proj's partial outputs
        # (llm_engine/tp_sharding.py shard_lean_body); None: one rank, nothing to sum.
        self.tp_handle: int | None = None

    def _sum_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp_handle is None else tp_all_reduce(x, self.tp_handle)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: the previous layer's output [T, hidden] (the embeddings for layer 0), residual its input
        stream (None for layer 0) → (this layer's MLP output, the residual stream before it)."""
        residual = hidden if residual is None else residual + hidden
        x = rms_norm(residual, self.input_norm, self.eps)
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        kv_shape = (num_tokens, self.num_kv_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(kv_shape)
        v = qkv[:, self.q_size + self.kv_size :].view(kv_shape)
        if self.q_norm is not None and self.k_norm is not None:
            q = rms_norm(q, self.q_norm, self.qk_eps)
            k = rms_norm(k, self.k_norm, self.qk_eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = paged_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.layer_idx, self.scaling)
        residual = residual + self._sum_over_ranks(self.o_proj(attn.view(num_tokens, self.q_size)))
        x = rms_norm(residual, self.post_attention_norm, self.eps)
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        mlp_out = self._sum_over_ranks(self.down_proj(nn.functional.silu(gate) * up))
        return mlp_out, residual


class LeanBody(nn.Module):
    """Embeddings → decoder layers → final norm, over a packed batch."""

    embed_tokens: nn.Module
    norm: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, embed_tokens: nn.Module, layers: list[LeanLayer], norm: nn.Parameter, eps: float,
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
        """cos/sin: [max_positions, head_dim] each, in the model's dtype."""
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.eps = eps
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @classmethod
    def from_hf(cls, hf_model: PreTrainedModel, max_positions: int) -> LeanBody:
        """The lean body over `hf_model`'s weights; the transformers layers are dropped from `hf_model`
        (their q/k/v and gate/up weights now live fused in the body), its embeddings and lm_head kept.
        cos/sin come from the model's own rotary module (every rope scaling transformers knows)."""
        inner: Any = hf_model.model
        config: Any = hf_model.config
        layers = [LeanLayer(LayerWeights.from_hf_layer(layer), i, config.num_attention_heads,
                            config.num_key_value_heads, layer.self_attn.head_dim)
                  for i, layer in enumerate(inner.layers)]
        weight: torch.Tensor = inner.embed_tokens.weight
        positions = torch.arange(max_positions, device=weight.device)[None]
        with torch.no_grad():
            cos, sin = inner.rotary_emb(weight[:1][None], positions)
        body = cls(inner.embed_tokens, layers, inner.norm.weight, float(inner.norm.variance_epsilon), cos[0],
                   sin[0])
        inner.layers = nn.ModuleList()
        return body

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] → [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]  # [T, 1, D]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin)
        assert residual is not None
        return rms_norm(residual + hidden, self.norm, self.eps)


def has_lean_body(architecture: str) -> bool:
    return architecture in LEAN_ARCHITECTURES
