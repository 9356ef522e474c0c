"""The KV cache's element type: the model's dtype, or 8-bit floats (vLLM's `--kv-cache-dtype` names), and
the two places that cross it: a forward writing its new keys and values into the cache, and attention reading
them back.

    kv_cache_torch_dtype("fp8", torch.bfloat16) → torch.float8_e4m3fn
    store(flat_cache, rows, x)   x cast to the cache's type (saturating at its largest finite value), written
    load(gathered, dtype)        the gathered keys or values in the activations' type
8-bit values are stored as they are, with no scale (vLLM's fp8 cache without calibrated scales: scale 1.0):
keys and values of the families served here lie well inside e4m3's ±448 (a value past it is clipped, never
an inf). Half the bytes of bfloat16: a worker holds twice the tokens in the same memory, and a handoff between
two such workers moves half the bytes (the KV layout's fingerprint names the dtype, so a bfloat16 peer is
refused at peering rather than read as the wrong bytes).
"""

from __future__ import annotations

import torch

from llm_engine.config import EIGHT_BIT_KV_DTYPES


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a --kv-cache-dtype name ("auto": the model's)."""
    return model_dtype if name == "auto" else getattr(torch, EIGHT_BIT_KV_DTYPES[name])


def is_eight_bit(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def store(flat: torch.Tensor, rows: torch.Tensor, x: torch.Tensor) -> None:
    """flat[rows] = x, cast to the cache's dtype. An 8-bit cache is written through its bytes: torch's CPU
    index_copy_ has no float8 kernel."""
    if flat.dtype == x.dtype:
        flat.index_copy_(0, rows, x)
        return
    if is_eight_bit(flat.dtype):
        limit = torch.finfo(flat.dtype).max
        x = x.clamp(-limit, limit).to(flat.dtype)  # e5m2 would round past its range to inf
        flat.view(torch.uint8).index_copy_(0, rows, x.view(torch.uint8))
        return
    flat.index_copy_(0, rows, x.to(flat.dtype))


def load(gathered: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values gathered from the cache, in the activations' dtype."""
    return gathered if gathered.dtype == dtype else gathered.to(dtype)
