"""The KV cache's element type: the model's dtype, 8-bit floats, or int8 with a scale per token and head
(vLLM's `--kv-cache-dtype` names), and the two places that cross it: a forward writing its new keys and
values into the cache, and attention reading them back.

    kv_cache_torch_dtype("fp8", torch.bfloat16) → torch.float8_e4m3fn
    stored_head_dim(dtype, head_dim)  elements a head takes in a cache row of that type
    store(flat_cache, rows, x)        x cast to the cache's type (saturating at its largest finite value), or
                                      quantized per token and head (int8), written
    load(gathered, dtype)             the gathered keys or values in the activations' type
8-bit floats are stored as they are, with no scale (vLLM's fp8 cache without calibrated scales: scale 1.0):
keys and values of the families served here lie well inside e4m3's ±448 (a value past it is clipped, never
an inf). Half the bytes of bfloat16: a worker holds twice the tokens in the same memory, and a handoff between
two such workers moves half the bytes (the KV layout's fingerprint names the dtype).
`int8_per_token_head` (vLLM's scheme) keeps each token's head as int8 values and a float32 scale, its absmax
/ 127 (values rounded to nearest). The scale lies in the head's own row, after its head_dim values (4 int8
elements holding the float32's bytes): a block carries its scales wherever its bytes go (a handoff, a
migration, a tensor-parallel rank's heads), so no transfer path learns of them. 68 bytes a head of 64
against bfloat16's 128: 1.88× the tokens in the same memory, and a finer grid than fp8's for small values.
"""

from __future__ import annotations

import torch

from llm_engine.config import EIGHT_BIT_KV_DTYPES

INT8_SCHEME = "int8_per_token_head"
_SCALE_ELEMENTS = 4  # the float32 scale's bytes, as int8 elements after a head's values


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a --kv-cache-dtype name ("auto": the model's; int8: per token and head)."""
    if name == INT8_SCHEME:
        return torch.int8
    return model_dtype if name == "auto" else getattr(torch, EIGHT_BIT_KV_DTYPES[name])


def stored_head_dim(dtype: torch.dtype, head_dim: int) -> int:
    """Elements one head of one token takes in a cache of `dtype`: its values, and an int8 cache's scale."""
    return head_dim + _SCALE_ELEMENTS if dtype == torch.int8 else head_dim


def is_eight_bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def store(flat: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """flat[rows] = x, cast to the cache's dtype. An 8-bit cache is written through its bytes: torch's CPU
    index_copy_ has no float8 kernel."""
    if flat.dtype == x.dtype:
        flat.index_copy_(0, rows, x)
        return
    if flat.dtype == torch.int8:
        flat.index_copy_(0, rows, _quantize_per_token_head(x, flat.shape[1]))
        return
    if is_eight_bit(flat.dtype):
        limit = torch.finfo(flat.dtype).max
        x = x.clamp(-limit, limit).to(flat.dtype)  # e5m2 would round past its range to inf
        flat.view(torch.uint8).index_copy_(0, rows, x.view(torch.uint8))
        return
    flat.index_copy_(0, rows, x.to(flat.dtype))


def load(gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values gathered from the cache ([..., stored_head_dim]), in the activations' dtype
    ([..., head_dim])."""
    if gathered.dtype == torch.int8:
        scale = gathered[..., -_SCALE_ELEMENTS:].contiguous().view(torch.float32)  # [..., 1]
        return (gathered[..., :-_SCALE_ELEMENTS].float() * scale).to(dtype)
    return gathered if gathered.dtype == dtype else gathered.to(dtype)


def _quantize_per_token_head(x: torch.Tensor, row_elements: int) -> torch.Tensor:
    """x: [T, heads × head_dim] → [T, row_elements] int8 rows: each head's values, then its scale's bytes."""
    num_tokens, width = x.shape
    num_heads = (row_elements - width) // _SCALE_ELEMENTS
    heads = x.view(num_tokens, num_heads, width // num_heads).float()
    scale = heads.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / 127.0
    values = (heads / scale).round_().clamp_(-128, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], -1).view(num_tokens, row_elements)
