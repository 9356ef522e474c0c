"""Writing pulled blocks into a cache of another element type: the converting handoff (a bfloat16 prefill
worker's KV into an fp8 decode worker's cache, and back).

    converted(x, dtype)                      x in `dtype`; into an 8-bit float, saturating at its largest
                                             finite value (never an inf or a NaN)
    write_blocks(cache, block_ids, blocks)   cache[block_ids] = blocks, converted to the cache's type
The source's bytes move as they are (kv_transfer/layout.py converts() says when): the receiver reads them into
a staging buffer in the source's type and converts them there, once they have all arrived, so the wire carries
the source's bytes and no backend learns a second element type. The rounding is the one a forward writing
into an 8-bit cache does (llm_engine/kv_dtype.py store): a decode worker with an fp8 cache holds the same
values for a prompt whether its KV was computed there or pulled from a bfloat16 prefill worker.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kv_transfer.layout import KVLayout

_EIGHT_BIT = (torch.float8_e4m3fn, torch.float8_e5m2)


def converted(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` (the tensor itself where it already is)."""
    if x.dtype == dtype:
        return x
    if dtype in _EIGHT_BIT:
        limit = torch.finfo(dtype).max  # e5m2 would round past its range to inf, e4m3fn to NaN
        wide = x.float() if x.dtype in _EIGHT_BIT else x  # CPU clamp has no float8 kernel
        return wide.clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def write_blocks(cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor) -> None:
    """cache[block_ids] = blocks, converted to the cache's type: one index_copy_ over the bytes (torch's CPU
    index_copy_ has no float8 kernel).

    Args:
        cache: [num_blocks, layers, 2, block_size, kv_heads, head_dim].
        block_ids: destination blocks, one per row of `blocks`.
        blocks: [len(block_ids), layers, 2, block_size, kv_heads, head_dim], any float type.
    """
    index = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
    cache.view(torch.uint8).index_copy_(0, index, converted(blocks, cache.dtype).view(torch.uint8))


def torch_dtype(layout: KVLayout) -> torch.dtype:
    """The torch type of a layout's elements (KVLayout.dtype names it without the "torch." prefix)."""
    dtype = getattr(torch, layout.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a KV layout names the element type {layout.dtype!r}, which torch does not know")
    return dtype


def block_shape(layout: KVLayout) -> tuple[int, int, int, int, int]:
    """One block of a layout's whole heads: [layers, 2, block_size, kv_heads, head_dim]."""
    return (layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
