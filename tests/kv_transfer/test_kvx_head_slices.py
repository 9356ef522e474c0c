"""plan_slice_reads: between workers of any two tensor-parallel degrees, the planned descriptors, copied byte
for byte, give every destination rank exactly its heads of the source blocks (no NIXL here: a memmove per
descriptor; test_kvx_nixl reads them through NIXL)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from kv_transfer.head_slices import plan_slice_reads
from kv_transfer.layout import KVLayout, layout_from_tensor, rank_slices_layout

LAYERS, BLOCK_SIZE, HEADS, HEAD_DIM, BLOCKS = 2, 4, 3, 8, 6


def split(shares: list[tuple[int, int]], dtype: torch.dtype) -> tuple[KVLayout, list[torch.Tensor]]:
    """A worker whose ranks hold these (first KV head, KV heads) slices; one share of all heads: one rank."""
    caches = [torch.zeros(BLOCKS, LAYERS, 2, BLOCK_SIZE, n, HEAD_DIM, dtype=dtype) for _, n in shares]
    if len(shares) == 1:
        return layout_from_tensor(caches[0]), caches
    regions = [layout_from_tensor(c).regions[0] for c in caches]
    return rank_slices_layout([(f, n, r) for (f, n), r in zip(shares, regions, strict=True)],
                              layout_from_tensor(caches[0])), caches


def whole(caches: list[torch.Tensor], shares: list[tuple[int, int]]) -> torch.Tensor:
    """The whole-head cache the ranks' slices make up (each head from the first rank that holds it)."""
    out = torch.full((BLOCKS, LAYERS, 2, BLOCK_SIZE, HEADS, HEAD_DIM), float("nan"), dtype=caches[0].dtype)
    for (first, num), cache in reversed(list(zip(shares, caches, strict=True))):
        out[..., first:first + num, :] = cache
    return out


SHARES = {1: [(0, 3)], 2: [(0, 2), (2, 1)], 3: [(0, 1), (1, 1), (2, 1)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 2), (2, 3), (3, 2), (1, 1)])
def test_each_destination_rank_gets_its_heads_of_the_source_blocks(src_tp: int, dst_tp: int,
                                                                    dtype: torch.dtype) -> None:
    src, src_caches = split(SHARES[src_tp], dtype)
    dst, dst_caches = split(SHARES[dst_tp], dtype)
    assert src.fingerprint == dst.fingerprint  # any degree's blocks mean the same bytes
    for cache in src_caches:
        cache.copy_(torch.randn(cache.shape))
    src_ids, dst_ids = (1, 2, 5), (4, 0, 3)
    reads = plan_slice_reads(src, dst, src_ids, dst_ids)
    for read in reads:
        local, remote = read.direct()
        for (dst_addr, length, _), (src_addr, src_length, _) in zip(local, remote, strict=True):
            assert length == src_length
            ctypes.memmove(int(dst_addr), int(src_addr), int(length))
    expected = whole(src_caches, SHARES[src_tp])[list(src_ids)]
    got = whole(dst_caches, SHARES[dst_tp])
    assert torch.equal(got[list(dst_ids)], expected)
    untouched = [b for b in range(BLOCKS) if b not in dst_ids]
    assert not whole(dst_caches, SHARES[dst_tp])[untouched].any()
    # Every destination byte read once: no head read twice, none missed.
    bytes_per_block = LAYERS * 2 * BLOCK_SIZE * HEADS * HEAD_DIM * src_caches[0].element_size()
    assert sum(int(r.direct()[0][:, 1].sum()) for r in reads) == len(dst_ids) * bytes_per_block


def test_ranks_that_hold_the_same_heads_read_whole_blocks() -> None:
    src, _ = split(SHARES[2], torch.float32)
    dst, _ = split(SHARES[2], torch.float32)
    reads = plan_slice_reads(src, dst, (0, 1), (2, 3))
    assert [(r.src.rank, r.dst.rank, len(r.direct()[0])) for r in reads] == [(0, 0, 2), (1, 1, 2)]


def test_replicated_heads_are_read_from_the_first_rank_that_holds_them() -> None:
    # 4 ranks over 2 KV heads: heads 0, 0, 1, 1 (llm_engine/rank_shares.py); to one rank of both heads.
    src, _ = split([(0, 1), (0, 1), (1, 1), (1, 1)], torch.float32)
    dst, _ = split([(0, 2)], torch.float32)
    assert [r.src.rank for r in plan_slice_reads(src, dst, (0,), (0,))] == [0, 2]


@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 3), (3, 2), (1, 1), (2, 2)])
def test_a_staged_read_copies_the_same_heads_from_scratch(src_tp: int, dst_tp: int,
                                                          dst_dtype: torch.dtype) -> None:
    """Ranks whose heads differ stage; so does every read into a cache of another type (an fp8 destination),
    converting as it copies out, whatever the heads."""
    src, src_caches = split(SHARES[src_tp], torch.bfloat16)
    dst, dst_caches = split(SHARES[dst_tp], dst_dtype)
    for cache in src_caches:
        cache.copy_(torch.randn(cache.shape))
    src_ids, dst_ids = (0, 3), (5, 1)
    for read in plan_slice_reads(src, dst, src_ids, dst_ids):
        scratch = torch.zeros(read.staged_bytes + 64, dtype=torch.uint8)
        local, remote = read.direct() if read.same_heads else read.staged(scratch.data_ptr() + 64, 0)
        for (dst_addr, length, _), (src_addr, _, _) in zip(local, remote, strict=True):
            ctypes.memmove(int(dst_addr), int(src_addr), int(length))
        if not read.same_heads:
            read.copy_staged(scratch[64:], dst_caches[read.dst.rank])
    expected = whole(src_caches, SHARES[src_tp])[list(src_ids)].to(dst_dtype)
    assert torch.equal(whole(dst_caches, SHARES[dst_tp])[list(dst_ids)].float(), expected.float())
    if dst_dtype != torch.bfloat16:
        with pytest.raises(ValueError, match="goes through the scratch"):
            plan_slice_reads(src, dst, src_ids, dst_ids)[0].direct()
