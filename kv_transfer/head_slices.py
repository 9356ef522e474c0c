"""Which bytes a pull between workers of different tensor-parallel degrees reads: each destination rank its
own KV heads, each from the source rank that holds them (kv_transfer/layout.py RankSlice).

A block of a rank's cache is [layers, 2, block_size, heads, head_dim]: a head range is contiguous only within
one row (one token of one layer's K or V). So a pair of ranks that hold the same heads reads whole blocks
(one descriptor per block; NIXL merges adjacent ones), and a pair whose heads differ reads either
    staged: the source rank's whole blocks into a scratch buffer of the destination rank, then a local copy
        of the shared heads into the cache (more bytes over the wire where the source holds heads the
        destination rank does not, one descriptor per block); a pull larger than the scratch is staged in
        ranges of blocks through one slot of it, each range read once the last one is copied out
        (kv_transfer/backends/nixl_ranks.py SliceReads), or
    direct: one descriptor per row (layers × 2 × block_size per block, each the shared heads × head_dim
        elements), straight into the cache: what a pull does only when no slot of its scratch is free.
A pull into a cache of another element type (kv_transfer/layout.py converts()) is always staged, whatever
the heads: the scratch takes the source's bytes and the copy into the cache converts them.
Why staged first: a descriptor costs about a microsecond in UCX here whatever its size (15,360 rows of
128-256 bytes: 13 ms to post), and a row is 64-512 bytes in the models we serve. Why not head-major blocks
(vLLM's NixlConnector asks for them with heterogeneous TP): every kernel reads the token-major layout.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kv_transfer.conversion import converted, torch_dtype
from kv_transfer.layout import KVLayout, RankSlice, coalesce_runs, converts, layout_slices


@dataclass(frozen=True)
class SliceRead:
    """What one destination rank reads from one source rank: KV heads [lo, hi) of the blocks (internal)."""

    src: RankSlice
    dst: RankSlice
    lo: int
    hi: int
    src_ids: np.ndarray  # uint64 block ids, pairwise with dst_ids
    dst_ids: np.ndarray
    rows: int  # rows per block: layers × 2 × block_size
    head_bytes: int  # head_dim × the source's element size
    src_dtype: torch.dtype  # the source's elements (the scratch holds them; the copy out converts)
    converts: bool = False  # the destination holds another element type: staged, never direct

    @property
    def same_heads(self) -> bool:
        """Both ranks hold exactly the heads read in the same type: whole blocks read into the cache."""
        return not self.converts and (self.src.first_kv_head, self.src.num_kv_heads, self.dst.first_kv_head,
                                      self.dst.num_kv_heads) == (self.lo, self.hi - self.lo, self.lo,
                                                                 self.hi - self.lo)

    @property
    def staged_bytes(self) -> int:
        """Scratch a staged read takes: the source rank's whole blocks."""
        return len(self.src_ids) * self._block_bytes(self.src)

    def direct(self) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) descriptors, [n, 3] uint64 (address, bytes, device id): into the cache."""
        if self.converts:
            raise ValueError("a read that converts its elements goes through the scratch, never direct")
        whole = self.same_heads
        return (_descriptors(self.dst, self.dst_ids, self.lo, self.hi, self.rows, self.head_bytes, whole),
                _descriptors(self.src, self.src_ids, self.lo, self.hi, self.rows, self.head_bytes, whole))

    @property
    def src_block_bytes(self) -> int:
        return self._block_bytes(self.src)

    def split(self, max_blocks: int) -> list[SliceRead]:
        """The same read in ranges of at most `max_blocks` blocks, in order."""
        ranges = (slice(i, i + max_blocks) for i in range(0, len(self.src_ids), max_blocks))
        return [replace(self, src_ids=self.src_ids[r], dst_ids=self.dst_ids[r]) for r in ranges]

    def staged(self, scratch: int, device_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(local, remote) descriptors of the source's whole blocks into scratch bytes from address
        `scratch` on, block after block."""
        block_bytes = self._block_bytes(self.src)
        local = np.empty((len(self.src_ids), 3), dtype=np.uint64)
        local[:, 0] = scratch + np.arange(len(self.src_ids), dtype=np.uint64) * np.uint64(block_bytes)
        local[:, 1] = block_bytes
        local[:, 2] = device_id
        return local, _descriptors(self.src, self.src_ids, self.lo, self.hi, self.rows, self.head_bytes, True)

    def copy_staged(self, scratch: torch.Tensor, cache: torch.Tensor) -> None:
        """Once a staged read is done: the shared heads of `scratch` (uint8, from the read's first byte)
        into the destination rank's `cache` ([blocks, layers, 2, block_size, heads, head_dim]), converted to
        its element type where it holds another (kv_transfer/conversion.py)."""
        shape = (len(self.src_ids), *cache.shape[1:4], self.src.num_kv_heads, cache.shape[5])
        source = converted(scratch[:self.staged_bytes].view(self.src_dtype).view(shape)[
            :, :, :, :, self.lo - self.src.first_kv_head : self.hi - self.src.first_kv_head], cache.dtype)
        first, last = self.lo - self.dst.first_kv_head, self.hi - self.dst.first_kv_head
        # One strided copy per run of consecutive destination blocks: 3x an index_put over the same heads.
        for read_start, block, count in coalesce_runs(tuple(range(len(self.dst_ids))),
                                                      tuple(int(b) for b in self.dst_ids)):
            cache[block : block + count, :, :, :, first:last].copy_(source[read_start : read_start + count])

    def _block_bytes(self, rank: RankSlice) -> int:
        return self.rows * rank.num_kv_heads * self.head_bytes


def plan_slice_reads(src: KVLayout, dst: KVLayout, src_ids: tuple[int, ...],
                     dst_ids: tuple[int, ...]) -> list[SliceRead]:
    """The reads that put every destination rank's heads of `src_ids` into its blocks `dst_ids`.

    Args:
        src, dst: compatible layouts (check_compatible), with or without rank slices; where their element
            types differ every read is staged and converted on its way into the cache.
        src_ids, dst_ids: block ids, pairwise.

    Returns:
        One SliceRead per (destination rank, source rank) that share heads; a head held by several source
        ranks (replicated KV heads) is read from the first.
    """
    rows = src.num_layers * 2 * src.block_size
    head_bytes = src.block_bytes // (rows * src.num_kv_heads)
    src_dtype, converting = torch_dtype(src), converts(src, dst)
    src_blocks = np.asarray(src_ids, dtype=np.uint64)
    dst_blocks = np.asarray(dst_ids, dtype=np.uint64)
    reads: list[SliceRead] = []
    for d in layout_slices(dst):
        covered, end = d.first_kv_head, d.first_kv_head + d.num_kv_heads
        for s in layout_slices(src):
            lo, hi = max(covered, s.first_kv_head), min(end, s.first_kv_head + s.num_kv_heads)
            if hi > lo:
                reads.append(SliceRead(s, d, lo, hi, src_blocks, dst_blocks, rows, head_bytes, src_dtype,
                                           converting))
                covered = hi
        if covered != end:
            raise ValueError(f"no source rank holds KV heads [{covered}, {end}) of destination rank {d.rank}")
    return reads


def _descriptors(rank: RankSlice, blocks: np.ndarray, lo: int, hi: int, rows: int, head_bytes: int,
                 whole: bool) -> np.ndarray:
    """(address, bytes, device) of heads [lo, hi) of `blocks` in `rank`'s memory: one row per block when
    `whole` (the whole block), else one per block row."""
    row_bytes = rank.num_kv_heads * head_bytes
    block_bytes = rows * row_bytes
    starts = rank.region.address + (blocks - np.uint64(rank.region.first_block)) * np.uint64(block_bytes)
    if whole:
        length = block_bytes
    else:
        offset = (lo - rank.first_kv_head) * head_bytes
        within = np.arange(rows, dtype=np.uint64) * np.uint64(row_bytes) + np.uint64(offset)
        starts = (starts[:, None] + within[None, :]).ravel()
        length = (hi - lo) * head_bytes
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = starts
    descs[:, 1] = length
    descs[:, 2] = rank.region.device_id
    return descs
