"""Attention over the paged KV cache, plugged into transformers' model definitions.

`register()` adds the "pdserve_paged" implementation to transformers' AttentionInterface; a model loaded
with `attn_implementation="pdserve_paged"` then calls `paged_attention_forward` in every layer, after its
own projections and rotary embedding. The forward runs on a *packed* batch: all requests' new tokens in one
row ([1, T]), with explicit position ids, and a `PagedAttentionMetadata` passed as a model kwarg that says
where each token's KV goes and what each token may attend to (input_batch.py builds it once per forward).
Views of the cache (a 2-d view of every token row, each layer's K and V as rows of whole blocks) are made
once per cache (CacheViews), and the slot rows of every layer once per forward: made per layer, their
dispatches were a few percent of a batch-1 decode step on a CPU.
Per layer:
    1. write the new K/V of all T tokens into their slots (block id, offset in block: one row each);
    2. prefill chunks: attend causally to (cached context + the chunk itself), one SDPA per chunk;
    3. decode tokens: with pdserve's C++ kernel (llm_engine/csrc/, CPU), one call reading every sequence's
       blocks in place; else gather all their block tables at once, one batched SDPA with a length mask.
On CUDA in float16/bfloat16, steps 2 and 3 are one FlashAttention call over the whole packed batch
(llm_engine/varlen_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import llm_engine.kv_dtype as kv_dtype
from llm_engine.native_kernels import DecodeKernel
from llm_engine.varlen_attention import VarlenBatch, attend_varlen

ATTENTION_NAME = "pdserve_paged"


@dataclass(frozen=True)
class PrefillSegment:
    """A prompt chunk (more than one new token, or one token of a request with nothing cached)."""

    q_start: int  # first row of the chunk in the packed batch
    q_len: int
    context_len: int  # tokens attended to: cached context + the chunk
    block_ids: torch.Tensor | None  # [num_blocks]; None when the chunk is the whole context (read fresh K/V)
    mask: torch.Tensor | None  # [q_len, context_len] bool; None when causal over the chunk alone suffices


@dataclass(frozen=True)
class DecodeBatch:
    """All single-token rows of the batch, attended to in one padded SDPA."""

    q_indices: torch.Tensor | slice  # [B] rows of the packed batch; a slice when they are consecutive
    block_tables: torch.Tensor  # [B * num_blocks], row by row; past a row's own table, any valid block id
    gathered_shape: tuple[int, int, int, int]  # [B, num_blocks * block_size, kv_heads, head_dim]
    num_keys: int  # the longest context among the rows: keys past it are not attended to at all
    mask: torch.Tensor | None  # [B, 1, 1, num_keys] additive (0 / -inf); None when all equal or a kernel runs
    # For the C++ kernel only (None on the SDPA path):
    tables: torch.Tensor | None  # [B, num_blocks] int64: block_tables as rows
    context_lens: torch.Tensor | None  # [B] int64: keys each row attends to, its own included


@dataclass(frozen=True)
class CacheViews:
    """Views of one KV cache, made once (see the module docstring)."""

    flat: torch.Tensor  # [num_blocks * layers * 2 * block_size, kvh * head_dim]: one token's K or V per row
    blocks: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer: K, V as [num_blocks, block elements]
    row_offsets: torch.Tensor  # [layers * 2]: rows from a block's first row to layer l's K (2l) and V (2l+1)
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer: K, V as [num_blocks, block, KVH, D]


def cache_views(kv_cache: torch.Tensor) -> CacheViews:
    """kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]."""
    num_layers, block_size = kv_cache.shape[1], kv_cache.shape[3]
    return CacheViews(
        flat=kv_cache.view(-1, kv_cache.shape[4] * kv_cache.shape[5]),
        blocks=tuple((kv_cache[:, layer, 0].flatten(1), kv_cache[:, layer, 1].flatten(1))
                     for layer in range(num_layers)),
        row_offsets=torch.arange(num_layers * 2, device=kv_cache.device) * block_size,
        layers=tuple((kv_cache[:, layer, 0], kv_cache[:, layer, 1]) for layer in range(num_layers)),
    )


@dataclass(frozen=True)
class PagedAttentionMetadata:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    views: CacheViews  # of kv_cache
    slot_blocks: torch.Tensor  # [T] block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    slot_rows: torch.Tensor  # [T] row of each token's layer-0 K in views.flat
    # [T] rows of each token's K (2l) and V (2l + 1) of layer l in views.flat
    layer_slot_rows: tuple[torch.Tensor, ...]
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None
    decode_kernel: DecodeKernel | None  # the C++ paged decode attention; None: gather + SDPA
    # CUDA: the whole batch in one FlashAttention call per layer (llm_engine/varlen_attention.py); then
    # `prefills` and `decode` are empty.
    varlen: VarlenBatch | None = None


def _gather(blocks: torch.Tensor, block_ids: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
            ) -> torch.Tensor:
    # blocks: one layer's K or V as [num_blocks, block elements]; block_ids: flat → `shape`, one contiguous
    # copy, in `dtype` (an 8-bit cache's values widened: llm_engine/kv_dtype.py). index_select of whole rows
    # is ~9× faster on CPU than advanced indexing of the 6-d cache, which walks element by element.
    # The last dimension as the cache stores it (an int8 cache's heads carry their scales).
    return kv_dtype.load(blocks.index_select(0, block_ids).view(*shape[:-1], -1), dtype)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The AttentionInterface entry point.

    Args:
        query: [1, num_heads, T, head_dim] after rotary embedding; key/value: [1, num_kv_heads, T, head_dim].
        kwargs: must carry `paged_metadata` (PagedAttentionMetadata).

    Returns:
        ([1, T, num_heads, head_dim] attention output, None) as transformers expects.
    """
    meta: PagedAttentionMetadata = kwargs["paged_metadata"]
    layer: int = module.layer_idx  # type: ignore[assignment]
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the paged attention")
    out = attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), layer, meta,
                 scaling, kwargs.get("sliding_window"))
    return out[None], None


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
           meta: PagedAttentionMetadata, scaling: float | None, sliding_window: int | None = None
           ) -> torch.Tensor:
    """One layer's paged attention over a packed batch: the engine's own model bodies call it (through the
    `pdserve::paged_attention` op, llm_engine/custom_ops.py) and so does transformers' (above).

    Args:
        query: [T, num_heads, head_dim] after rotary embedding; key/value: [T, num_kv_heads, head_dim].

    Returns:
        [T, num_heads, head_dim].
    """
    if sliding_window is not None:
        _check_within_window(meta, sliding_window)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    # One index_copy_ of whole rows into a 2-d view of the cache, not an index_put of (block, offset) pairs
    # into the 6-d cache, which walks element by element.
    flat = meta.views.flat
    kv_dtype.store(flat, meta.layer_slot_rows[2 * layer], key.reshape(num_tokens, -1))
    kv_dtype.store(flat, meta.layer_slot_rows[2 * layer + 1], value.reshape(num_tokens, -1))
    if meta.varlen is not None:
        return attend_varlen(query, flat, layer, meta.varlen, num_kv_heads, scaling)

    d = meta.decode
    layer_blocks = meta.views.blocks[layer]
    is_all_decode = d is not None and isinstance(d.q_indices, slice) and d.q_indices.stop == num_tokens
    if d is not None and is_all_decode and not meta.prefills:
        # Every row is a decode row (the slice starts at 0 then): no output buffer to allocate and fill.
        return _decode(query, meta, layer, d, num_kv_heads, scaling)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        q = query[rows].transpose(0, 1)[None]  # [1, H, q_len, D]
        if seg.block_ids is None:
            k, v = key[rows].transpose(0, 1)[None], value[rows].transpose(0, 1)[None]  # [1, KVH, q_len, D]
        else:
            _, _, _, block_size, kv_heads, _ = meta.kv_cache.shape
            shape = (len(seg.block_ids) * block_size, kv_heads, head_dim)
            context = seg.context_len
            k = _gather(layer_blocks[0], seg.block_ids, shape, query.dtype)[:context].transpose(0, 1)[None]
            v = _gather(layer_blocks[1], seg.block_ids, shape, query.dtype)[:context].transpose(0, 1)[None]
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scaling, enable_gqa=True
        )  # [1, H, q_len, D]
        out[rows] = attn[0].transpose(0, 1)
    if d is not None:
        out[d.q_indices] = _decode(query, meta, layer, d, num_kv_heads, scaling)
    return out


def _check_within_window(meta: PagedAttentionMetadata, window: int) -> None:
    """Every context fits the layer's sliding window, where full attention and the window's agree. The
    loader caps max_model_len there (model_files.read_model_spec); this keeps a wrong cap from serving
    wrong tokens."""
    longest = max([s.context_len for s in meta.prefills] + ([meta.decode.num_keys] if meta.decode else []))
    if longest > window:
        raise RuntimeError(f"a context of {longest} tokens exceeds the model's sliding window of {window}: "
                           "the paged attention attends to whole contexts only")


def _decode(query: torch.Tensor, meta: PagedAttentionMetadata, layer: int, d: DecodeBatch,
            num_kv_heads: int, scaling: float | None) -> torch.Tensor:
    """The single-token rows' attention over their block tables: [B, H, D]. query: [T, H, D]."""
    q = query[d.q_indices]  # [B, H, D]
    num_batch, num_heads, head_dim = q.shape
    if meta.decode_kernel is not None:
        keys, values = meta.views.layers[layer]  # [num_blocks, block, KVH, D], read in place
        scale = head_dim ** -0.5 if scaling is None else scaling
        assert d.tables is not None and d.context_lens is not None  # built whenever the kernel is set
        return meta.decode_kernel(q.contiguous(), keys, values, d.tables, d.context_lens, scale)
    layer_blocks = meta.views.blocks[layer]
    # [B, KVH, L, D]
    num_keys = d.num_keys
    k = _gather(layer_blocks[0], d.block_tables, d.gathered_shape, query.dtype)[:, :num_keys].transpose(1, 2)
    v = _gather(layer_blocks[1], d.block_tables, d.gathered_shape, query.dtype)[:, :num_keys].transpose(1, 2)
    if query.dtype == torch.float32:
        # The query heads sharing a KV head become that head's "query positions": one SDPA call with no
        # repeated K/V (query head h reads KV head h // group, as transformers' repeat_kv does). In fp32 this
        # is ~25% faster than SDPA's own GQA and gives transformers' greedy tokens.
        q = q.reshape(num_batch, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KVH, G, D]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scaling)  # [B, KVH, G, D]
    else:
        # In bf16/fp16 the grouped form rounds differently from transformers' own call (one query row per
        # head, enable_gqa), which flips greedy tokens within 24 steps on SmolLM2; this form is bit-identical
        # to it and measured 10-20% faster than the grouped one in bf16.
        attn = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=d.mask, scale=scaling,
                                              enable_gqa=True)  # [B, H, 1, D]
    return attn.reshape(num_batch, num_heads, head_dim)


def register() -> None:
    """Make "pdserve_paged" a valid `attn_implementation` (idempotent). transformers is imported here, not
    at the top: a lean model loaded from its checkpoint never needs it (llm_engine/lean_loader.py)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
