"""Block pool and KV cache manager: after any sequence of allocate/append/free/share the pool is whole."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_engine.block_pool import BlockPool
from llm_engine.kv_cache_manager import KVCacheManager, hash_block, prefix_hashes

BLOCK = 4


def test_allocate_free_and_double_free() -> None:
    pool = BlockPool(8)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 5 and not pool.is_whole()
    assert not pool.can_allocate(6)
    with pytest.raises(RuntimeError, match="only 5 free"):
        pool.allocate(6)
    pool.free(blocks)
    assert pool.is_whole()
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks[:1])


def test_cached_block_is_revived_then_evicted_lru() -> None:
    pool = BlockPool(3)
    [a, b] = pool.allocate(2)
    pool.cache(a, b"hash-a")
    pool.cache(b, b"hash-b")
    pool.free([a, b])  # freed in reverse: b first, so b is evicted before a
    assert pool.lookup(b"hash-a") == a
    pool.touch([a])
    assert pool.blocks[a].ref_count == 1 and pool.num_free_blocks == 2
    pool.free([a])
    taken = pool.allocate(2)  # the never-cached block, then the least recently freed cached one (b)
    assert b in taken and pool.lookup(b"hash-b") is None and pool.lookup(b"hash-a") == a
    pool.free(taken)
    assert pool.is_whole()


def test_hash_chain_depends_on_whole_prefix() -> None:
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2])
    assert hash_block(b"x", [1, 2]) != hash_block(b"y", [1, 2])
    assert prefix_hashes([1, 2, 3, 4, 5], 2)[1] == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert len(prefix_hashes([1, 2, 3], 2)) == 1


def test_manager_shares_prefix_and_never_serves_the_last_token_from_cache() -> None:
    kv = KVCacheManager(BlockPool(16), BLOCK)
    prompt = list(range(12))  # exactly 3 blocks
    assert kv.allocate("a", prompt, 12) == 0
    kv.cache_full_blocks("a", prompt, 12)
    # Same prompt again: only 2 blocks are reused, the third holds the token whose logits we need.
    assert kv.allocate("b", prompt, 12) == 8
    assert kv.block_table("a")[:2] == kv.block_table("b")[:2]
    assert kv.block_table("a")[2] != kv.block_table("b")[2]
    kv.free("a")
    kv.free("b")
    kv.free("b")  # idempotent
    assert kv.pool.is_whole()


def test_can_allocate_counts_revived_free_blocks() -> None:
    kv = KVCacheManager(BlockPool(3), BLOCK)
    prompt = list(range(9))
    kv.allocate("a", prompt, 9)
    kv.cache_full_blocks("a", prompt, 9)
    kv.free("a")  # 3 free blocks, 2 of them caching prompt's prefix
    assert kv.can_allocate(prompt, 9)  # 2 revived + 1 new = 3
    assert not kv.can_allocate(prompt, 9, reserve_blocks=1)
    assert not kv.can_allocate(list(range(100, 113)), 13)  # 4 blocks, nothing cached


operations = st.lists(
    st.tuples(st.sampled_from(["new", "append", "free", "cache"]), st.integers(0, 5), st.integers(1, 30)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_any_sequence_leaves_the_pool_whole(ops: list[tuple[str, int, int]]) -> None:
    kv = KVCacheManager(BlockPool(20), BLOCK)
    # Two prompt families so that prefixes really are shared.
    tokens = {r: [r % 2] * 40 + [r] * 40 for r in range(6)}
    lengths: dict[int, int] = {}
    for op, r, n in ops:
        rid = f"r{r}"
        if op == "new" and not kv.has(rid) and kv.can_allocate(tokens[r], n):
            lengths[r] = max(n, kv.allocate(rid, tokens[r], n))
        elif op == "append" and kv.has(rid) and kv.can_append(rid, lengths[r] + n):
            kv.append(rid, lengths[r] + n)
            lengths[r] += n
        elif op == "cache" and kv.has(rid):
            kv.cache_full_blocks(rid, tokens[r], min(lengths[r], len(tokens[r])))
        elif op == "free":
            kv.free(rid)
        used = sum(1 for b in kv.pool.blocks if b.ref_count > 0)
        assert used == kv.pool.num_used_blocks
    for r in range(6):
        kv.free(f"r{r}")
    assert kv.pool.is_whole()
