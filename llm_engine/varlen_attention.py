"""Attention on CUDA: the whole packed batch (prefill chunks, prefix hits and decode tokens) in one
FlashAttention call per layer, through `torch.nn.attention.varlen.varlen_attn`.

    InputBatch.prepare → varlen_batch(...) once per forward: each chunk's keys as rows of the cache (its
        block table walked to its context length), cumulative query and key lengths
    attend(), per layer: write the new K/V into their slots → gather this layer's K and V rows of every
        chunk's context, packed [Tk, KVH, D] → one varlen_attn (causal, aligned bottom-right: a chunk's
        query i sees its cached context and its own first i + 1 tokens; a decode token sees its whole context)
Why not SDPA on CUDA: with a mask and grouped KV heads it falls to PyTorch's math kernel (fp32 scores, every
row padded to the longest context), and one call per prefill chunk launches a kernel per chunk per layer.
FlashAttention takes float16/bfloat16 only: a float32 model on CUDA keeps the SDPA path (`varlen_fits`).
Queries need no reordering: the packed batch already lays each chunk's tokens side by side, which is the
varlen layout. The keys are copied once per layer (a gather); FlashAttention's own paged form
(`block_table=`) would read them in place but constrains the block size, so it is left for a measured run
on a GPU (README, "CUDA").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from llm_engine.kv_dtype import load

# varlen_attn's signature, the parts used: (q [Tq, H, D], k [Tk, KVH, D], v, cu_seq_q [C+1] int32,
# cu_seq_k [C+1] int32, max_q, max_k, *, scale, window_size, enable_gqa) → [Tq, H, D].
VarlenKernel = Callable[..., torch.Tensor]
HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256  # FlashAttention's limit


@dataclass(frozen=True)
class VarlenBatch:
    """The packed batch as varlen_attn sees it: one sequence per chunk, in packed order."""

    layer_key_rows: tuple[torch.Tensor, ...]  # [Tk] flat-view rows of layer l: K at index 2l, V at 2l + 1
    cu_seq_q: torch.Tensor  # [C + 1] int32: where each chunk's queries start in the packed batch
    cu_seq_k: torch.Tensor  # [C + 1] int32: where each chunk's keys start in the gathered keys
    max_q: int  # the longest chunk
    max_k: int  # the longest context
    kernel: VarlenKernel  # varlen_attn (tests pass a reference with its semantics)


def varlen_fits(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the varlen path cannot serve here, or None where it can."""
    if device.type != "cuda":
        return "varlen attention is a CUDA kernel"
    if dtype not in HALF_DTYPES:
        return f"FlashAttention computes float16/bfloat16, the model runs {dtype}"
    if head_dim > MAX_HEAD_DIM or head_dim % 8:
        return f"FlashAttention takes head dims up to {MAX_HEAD_DIM} in multiples of 8, not {head_dim}"
    return None


def varlen_kernel() -> VarlenKernel | None:
    """torch's varlen_attn, or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn  # type: ignore[return-value]  # it returns a tuple only when asked (return_aux)


def varlen_batch(tables: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 block_size: int, block_rows: int, row_offsets: torch.Tensor, kernel: VarlenKernel,
                 to_device: Callable[[np.ndarray], torch.Tensor]) -> VarlenBatch:
    """Args:
        tables: [rows, max_blocks] block tables; rows: [C] each chunk's row; starts, counts: [C] each
            chunk's first position and number of new tokens (its context is starts + counts).
        block_rows: rows of one block in the cache's flat view (layers × 2 × block_size);
        row_offsets: [layers * 2] rows from a block's first row to layer l's K (2l) and V (2l + 1).
    """
    context_lens = starts + counts  # [C]
    key_starts = np.cumsum(context_lens) - context_lens
    num_keys = int(context_lens.sum())
    # Position of every key within its own chunk's context: [Tk].
    key_positions = np.arange(num_keys, dtype=np.int64) - np.repeat(key_starts, context_lens)
    key_blocks = tables[np.repeat(rows, context_lens), key_positions // block_size]
    base_rows = to_device(key_blocks * block_rows + key_positions % block_size)  # [Tk] layer 0's K rows
    cu_q = np.zeros(len(counts) + 1, dtype=np.int32)
    cu_k = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=cu_q[1:])
    np.cumsum(context_lens, out=cu_k[1:])
    return VarlenBatch(
        layer_key_rows=(base_rows[None] + row_offsets[:, None]).unbind(0),
        cu_seq_q=to_device(cu_q), cu_seq_k=to_device(cu_k),
        max_q=int(counts.max()), max_k=int(context_lens.max()), kernel=kernel,
    )


def attend_varlen(query: torch.Tensor, flat: torch.Tensor, layer: int, batch: VarlenBatch,
                  num_kv_heads: int, scaling: float | None) -> torch.Tensor:
    """query: [T, H, D]; flat: the cache's [rows, KVH * D] view, this step's K/V written → [T, H, D]."""
    stored = flat.shape[1] // num_kv_heads  # a head's elements in the cache (an int8 cache's carry scales)
    keys = load(flat.index_select(0, batch.layer_key_rows[2 * layer]).view(-1, num_kv_heads, stored),
                query.dtype)
    values = load(flat.index_select(0, batch.layer_key_rows[2 * layer + 1]).view(-1, num_kv_heads, stored),
                  query.dtype)
    return batch.kernel(query, keys, values, batch.cu_seq_q, batch.cu_seq_k, batch.max_q, batch.max_k,
                        scale=scaling, window_size=(-1, 0), enable_gqa=True)
