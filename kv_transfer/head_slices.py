"""Which bytes a pull between workers of different tensor-parallel degrees reads: each destination rank its
own KV heads, each from the source rank that holds them (kv_transfer/layout.py RankSlice).

A block of a rank's cache is [layers, 2, block_size, heads, head_dim]: a head range is contiguous only within
one row (one token of one layer's K or V). So a read between slices that differ is one descriptor per row
(layers × 2 × block_size per block, each the overlap's heads × head_dim elements); between slices that hold
the same heads it is one descriptor per block. NIXL merges descriptors adjacent on both sides.
Why not change the cache to head-major blocks (as vLLM's NixlConnector asks for heterogeneous TP): every
kernel reads the token-major layout; a row is 64-512 bytes here, a handful of descriptors per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kv_transfer.layout import KVLayout, RankSlice, layout_slices


@dataclass(frozen=True)
class SliceRead:
    """The descriptors one destination rank reads from one source rank (internal; never sent)."""

    src_rank: int
    dst_rank: int
    local: np.ndarray  # [n, 3] uint64: (address, bytes, device id) in the destination rank's memory
    remote: np.ndarray  # [n, 3] uint64: the same rows' bytes in the source rank's memory

    @property
    def num_bytes(self) -> int:
        return int(self.local[:, 1].sum())


def plan_slice_reads(src: KVLayout, dst: KVLayout, src_ids: tuple[int, ...],
                     dst_ids: tuple[int, ...]) -> list[SliceRead]:
    """The reads that put every destination rank's heads of `src_ids` into its blocks `dst_ids`.

    Args:
        src, dst: compatible layouts (check_compatible), with or without rank slices.
        src_ids, dst_ids: block ids, pairwise.

    Returns:
        One SliceRead per (destination rank, source rank) that share heads; a head held by several source
        ranks (replicated KV heads) is read from the first.
    """
    rows = src.num_layers * 2 * src.block_size
    head_bytes = src.block_bytes // (rows * src.num_kv_heads)
    src_blocks = np.asarray(src_ids, dtype=np.uint64)
    dst_blocks = np.asarray(dst_ids, dtype=np.uint64)
    reads: list[SliceRead] = []
    for d in layout_slices(dst):
        covered, end = d.first_kv_head, d.first_kv_head + d.num_kv_heads
        for s in layout_slices(src):
            lo, hi = max(covered, s.first_kv_head), min(end, s.first_kv_head + s.num_kv_heads)
            if hi <= lo:
                continue
            local = _descriptors(d, dst_blocks, lo, hi, rows, head_bytes, whole=_same_heads(d, s))
            remote = _descriptors(s, src_blocks, lo, hi, rows, head_bytes, whole=_same_heads(d, s))
            reads.append(SliceRead(s.rank, d.rank, local, remote))
            covered = hi
        if covered != end:
            raise ValueError(f"no source rank holds KV heads [{covered}, {end}) of destination rank {d.rank}")
    return reads


def _same_heads(a: RankSlice, b: RankSlice) -> bool:
    return (a.first_kv_head, a.num_kv_heads) == (b.first_kv_head, b.num_kv_heads)


def _descriptors(rank: RankSlice, blocks: np.ndarray, lo: int, hi: int, rows: int, head_bytes: int,
                 whole: bool) -> np.ndarray:
    """(address, bytes, device) of heads [lo, hi) of `blocks` in `rank`'s memory: one row per block when
    `whole` (the rank holds exactly those heads), else one per block row."""
    row_bytes = rank.num_kv_heads * head_bytes
    block_bytes = rows * row_bytes
    starts = rank.region.address + (blocks - np.uint64(rank.region.first_block)) * np.uint64(block_bytes)
    if whole:
        length = block_bytes
    else:
        within = np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes) + np.uint64((lo - rank.first_kv_head)
                                                                                       * head_bytes)
        starts = (starts[:, None] + within[None, :]).ravel()
        length = (hi - lo) * head_bytes
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = starts
    descs[:, 1] = length
    descs[:, 2] = rank.region.device_id
    return descs
