"""Attention over the paged KV cache, plugged into transformers' model definitions.

`register()` adds the "pdserve_paged" implementation to transformers' AttentionInterface; a model loaded
with `attn_implementation="pdserve_paged"` then calls `paged_attention_forward` in every layer, after its
own projections and rotary embedding. The forward runs on a *packed* batch: all requests' new tokens in one
row ([1, T]), with explicit position ids, and a `PagedAttentionMetadata` passed as a model kwarg that says
where each token's KV goes and what each token may attend to. Per layer:
    1. write the new K/V of all T tokens into their slots (block id, offset in block);
    2. prefill chunks: attend causally to (cached context + the chunk itself), one SDPA per chunk;
    3. decode tokens: gather all their block tables at once, one batched SDPA with a length mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from llm_engine.batch import ScheduledChunk

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

    q_indices: torch.Tensor  # [B] rows of the packed batch
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size] bool; None when no row is padded


@dataclass(frozen=True)
class PagedAttentionMetadata:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    slot_blocks: torch.Tensor  # [T] block id of each new token's slot
    slot_offsets: torch.Tensor  # [T] offset inside that block
    prefills: tuple[PrefillSegment, ...]
    decode: DecodeBatch | None


def build_metadata(chunks: tuple[ScheduledChunk, ...], kv_cache: torch.Tensor) -> PagedAttentionMetadata:
    """Describe a packed batch for the attention: shared by every layer of one forward."""
    device = kv_cache.device
    block_size = kv_cache.shape[3]
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    prefills = []
    decode_rows: list[int] = []
    decode_tables: list[tuple[int, ...]] = []
    decode_lens: list[int] = []
    row = 0
    for chunk in chunks:
        for position in range(chunk.start_position, chunk.context_len):
            slot_blocks.append(chunk.block_ids[position // block_size])
            slot_offsets.append(position % block_size)
        if chunk.num_tokens == 1 and chunk.start_position > 0:
            decode_rows.append(row)
            decode_tables.append(chunk.block_ids[: -(-chunk.context_len // block_size)])
            decode_lens.append(chunk.context_len)
        elif chunk.start_position == 0:
            prefills.append(PrefillSegment(row, chunk.num_tokens, chunk.num_tokens, None, None))
        else:
            num_blocks = -(-chunk.context_len // block_size)
            query_pos = torch.arange(chunk.start_position, chunk.context_len, device=device)
            key_pos = torch.arange(chunk.context_len, device=device)
            prefills.append(
                PrefillSegment(
                    q_start=row,
                    q_len=chunk.num_tokens,
                    context_len=chunk.context_len,
                    block_ids=torch.tensor(chunk.block_ids[:num_blocks], device=device),
                    mask=key_pos[None, :] <= query_pos[:, None],
                )
            )
        row += chunk.num_tokens
    decode = None
    if decode_rows:
        max_blocks = max(len(t) for t in decode_tables)
        tables = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in decode_tables], device=device)
        mask = None
        if min(decode_lens) != max_blocks * block_size:
            lens = torch.tensor(decode_lens, device=device)
            key_pos = torch.arange(max_blocks * block_size, device=device)
            mask = (key_pos[None, :] < lens[:, None])[:, None, None]
        decode = DecodeBatch(torch.tensor(decode_rows, device=device), tables, mask)
    return PagedAttentionMetadata(
        kv_cache=kv_cache,
        slot_blocks=torch.tensor(slot_blocks, device=device),
        slot_offsets=torch.tensor(slot_offsets, device=device),
        prefills=tuple(prefills),
        decode=decode,
    )


def _gather(kv_cache: torch.Tensor, block_ids: torch.Tensor, layer: int, kv: int) -> torch.Tensor:
    # block_ids: [..., nb] → [..., nb * block_size, kv_heads, head_dim], one contiguous copy.
    # index_select over a [num_blocks, block elements] view copies whole rows; it is ~9× faster on CPU
    # than advanced indexing of the 6-d cache, which walks element by element.
    _, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    rows = kv_cache[:, layer, kv].flatten(1)  # [num_blocks, block_size * kv_heads * head_dim], a view
    gathered = rows.index_select(0, block_ids.flatten())
    return gathered.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim)


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
    cache = meta.kv_cache
    new_k = key[0].transpose(0, 1)  # [T, kv_heads, head_dim]
    new_v = value[0].transpose(0, 1)
    cache[meta.slot_blocks, layer, 0, meta.slot_offsets] = new_k
    cache[meta.slot_blocks, layer, 1, meta.slot_offsets] = new_v

    num_tokens, num_heads, head_dim = query.shape[2], query.shape[1], query.shape[3]
    out = query.new_empty(1, num_tokens, num_heads, head_dim)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        q = query[:, :, rows]  # [1, H, q_len, D]
        if seg.block_ids is None:
            k, v = key[:, :, rows], value[:, :, rows]  # [1, KVH, q_len, D]
        else:
            k = _gather(cache, seg.block_ids, layer, 0)[: seg.context_len].transpose(0, 1)[None]
            v = _gather(cache, seg.block_ids, layer, 1)[: seg.context_len].transpose(0, 1)[None]
        attn = F.scaled_dot_product_attention(
            q, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scaling, enable_gqa=True
        )  # [1, H, q_len, D]
        out[0, rows] = attn[0].transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        num_kv_heads = key.shape[1]
        # The query heads sharing a KV head become that head's "query positions": one SDPA call with no
        # repeated K/V (query head h reads KV head h // group, as transformers' repeat_kv does).
        q = query[0, :, d.q_indices].transpose(0, 1)  # [B, H, D]
        q = q.reshape(q.shape[0], num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KVH, G, D]
        k = _gather(cache, d.block_tables, layer, 0).transpose(1, 2)  # [B, KVH, L, D]
        v = _gather(cache, d.block_tables, layer, 1).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scaling)  # [B, KVH, G, D]
        out[0, d.q_indices] = attn.reshape(attn.shape[0], num_heads, head_dim)
    return out, None


def register() -> None:
    """Make "pdserve_paged" a valid `attn_implementation` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
