"""Per-request block tables over a BlockPool, with hash-chained prefix sharing.

A request's table covers token positions [0, len(table) * block_size). Lifecycle of one request:
    can_allocate → allocate (shares cached prefix blocks, allocates the rest)
    → [can_append → append]* as chunks and decode tokens need more slots
    → cache_full_blocks after each forward (full blocks become shareable)
    → free (blocks return to the pool; cached ones stay revivable until evicted).
Plain Python, no tensors: the scheduler and the tests use it without a model.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from llm_engine.block_pool import BlockPool


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Stable 128-bit hash of one full block, chained to its predecessor so equal hashes mean equal prefixes.

    Stable across processes (unlike `hash()`), so a router can predict which worker holds a prefix.
    """
    digest = hashlib.blake2b(parent_hash or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def chain_root(cache_salt: str | None) -> bytes | None:
    """The parent of a request's first block hash: its cache salt's digest, so that requests with different
    salts (tenants) never share a block, nor see, through timing or counts, whether another one's prompt is
    cached. None (no salt): the shared, unsalted chain."""
    if cache_salt is None:
        return None
    return hashlib.blake2b(cache_salt.encode(), digest_size=16, person=b"pdserve-salt").digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, root: bytes | None = None) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, from `root` (chain_root of the request's salt)."""
    hashes: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Maps request ids to block tables; the only code that calls BlockPool.allocate/free for requests."""

    def __init__(self, pool: BlockPool, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        # Number of leading blocks of each request already registered in the prefix cache, and the chained
        # hash of the last of them, so each step hashes only the blocks that just filled.
        self._num_cached_blocks: dict[str, int] = {}
        self._last_hash: dict[str, bytes | None] = {}

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def num_cached_blocks(self, request_id: str) -> int:
        """Leading blocks of the request already registered in the prefix cache."""
        return self._num_cached_blocks[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[bytes] | None = None,
                           root: bytes | None = None) -> list[int]:
        """Block ids holding the longest cached prefix of `token_ids`.

        The last token is never served from cache: its forward produces the logits we sample from.

        Args:
            block_hashes: the chained hashes of the full blocks of `token_ids[:-1]` when the caller keeps them
                (the scheduler does, per request), so that they are not computed again.
            root: the chain's root (chain_root of the request's cache salt) when block_hashes is None.
        """
        if not self.enable_prefix_caching:
            return []
        if block_hashes is None:
            block_hashes = prefix_hashes(token_ids[: len(token_ids) - 1], self.block_size, root)
        block_ids = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def _num_free_needed(self, cached: list[int], num_tokens: int) -> int:
        num_new = max(0, blocks_for(num_tokens, self.block_size) - len(cached))
        # Reviving a free cached block also takes it out of the free queue.
        num_revived = sum(1 for b in cached if self.pool.blocks[b].ref_count == 0)
        return num_new + num_revived

    def can_allocate(self, token_ids: Sequence[int], num_tokens: int, reserve_blocks: int = 0,
                     block_hashes: Sequence[bytes] | None = None, root: bytes | None = None) -> bool:
        """Could a new request get slots for its first `num_tokens` tokens, leaving `reserve_blocks` free?"""
        cached = self.find_cached_prefix(token_ids, block_hashes, root)
        return self.pool.can_allocate(self._num_free_needed(cached, num_tokens) + reserve_blocks)

    def allocate(self, request_id: str, token_ids: Sequence[int], num_tokens: int,
                 block_hashes: Sequence[bytes] | None = None, root: bytes | None = None) -> int:
        """Give a new request a table covering `num_tokens` positions, sharing its cached prefix.

        Args:
            root: the chain's root (chain_root of the request's cache salt): the blocks it fills are cached
                under the chain from there, so that only requests of the same salt find them.

        Returns:
            The number of leading tokens whose KV is already in the shared blocks (a multiple of block_size).
        """
        if request_id in self._tables:
            raise RuntimeError(f"request {request_id} already holds blocks")
        cached = self.find_cached_prefix(token_ids, block_hashes, root)
        num_tokens = max(num_tokens, len(cached) * self.block_size)
        if not self.pool.can_allocate(self._num_free_needed(cached, num_tokens)):
            raise RuntimeError(f"not enough free blocks for request {request_id}")
        self.pool.touch(cached)
        num_new = blocks_for(num_tokens, self.block_size) - len(cached)
        self._tables[request_id] = cached + self.pool.allocate(num_new)
        self._num_cached_blocks[request_id] = len(cached)
        self._last_hash[request_id] = self.pool.blocks[cached[-1]].block_hash if cached else root
        return len(cached) * self.block_size

    def allocate_blocks(self, request_id: str, num_tokens: int, root: bytes | None = None) -> list[int]:
        """Give a new request fresh, unshared blocks for `num_tokens` positions (to receive a transfer);
        `root`: as allocate's (the received blocks are cached under the request's salted chain)."""
        if request_id in self._tables:
            raise RuntimeError(f"request {request_id} already holds blocks")
        self._tables[request_id] = self.pool.allocate(blocks_for(num_tokens, self.block_size))
        self._num_cached_blocks[request_id] = 0
        self._last_hash[request_id] = root
        return self._tables[request_id]

    def num_fork_blocks(self, num_tokens: int, num_children: int) -> int:
        """Free blocks fork() takes: one copy of the last partial block per child but the first."""
        return (num_children - 1) if num_tokens % self.block_size else 0

    def fork(self, parent_id: str, child_ids: Sequence[str], num_tokens: int) -> list[tuple[int, int]]:
        """Split the parent's table, covering `num_tokens` computed positions, into one table per child (the
        several choices of one prompt); the parent's id is gone afterwards.

        Full blocks are shared by reference (one more ref per child). The last, partial block is written by
        each child's next token, so it cannot be shared: the first child takes the parent's, every other child
        gets a fresh block that the caller must fill with a copy of it (copy-on-write, done at once).

        Returns:
            (source, destination) block pairs to copy before the children's next forward.
        """
        table = self._tables.pop(parent_id)
        num_cached = self._num_cached_blocks.pop(parent_id)
        last_hash = self._last_hash.pop(parent_id)
        if len(table) != blocks_for(num_tokens, self.block_size):
            raise RuntimeError(f"request {parent_id} holds {len(table)} blocks, not a table of {num_tokens} "
                               "tokens")
        if not self.pool.can_allocate(self.num_fork_blocks(num_tokens, len(child_ids))):
            self._tables[parent_id] = table  # nothing changed
            self._num_cached_blocks[parent_id], self._last_hash[parent_id] = num_cached, last_hash
            raise RuntimeError(f"not enough free blocks to fork request {parent_id}")
        num_full = num_tokens // self.block_size
        copies = []
        for i, child_id in enumerate(child_ids):
            if child_id in self._tables:
                raise RuntimeError(f"request {child_id} already holds blocks")
            if i == 0:
                child_table = table  # the parent's references become the first child's
            else:
                self.pool.touch(table[:num_full])
                child_table = table[:num_full]
                if num_full < len(table):
                    [copy] = self.pool.allocate(1)
                    copies.append((table[-1], copy))
                    child_table = [*child_table, copy]
            self._tables[child_id] = list(child_table)
            self._num_cached_blocks[child_id] = num_cached
            self._last_hash[child_id] = last_hash
        return copies

    def num_append_blocks(self, request_id: str, num_tokens: int) -> int:
        return max(0, blocks_for(num_tokens, self.block_size) - len(self._tables[request_id]))

    def can_append(self, request_id: str, num_tokens: int) -> bool:
        """Could the request's table grow to cover `num_tokens` positions in total?"""
        return self.pool.can_allocate(self.num_append_blocks(request_id, num_tokens))

    def append(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's table to cover `num_tokens` positions in total."""
        num_new = self.num_append_blocks(request_id, num_tokens)
        if num_new:
            self._tables[request_id].extend(self.pool.allocate(num_new))

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that are full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_cached_blocks[request_id]
        if num_full <= start:
            return
        parent = self._last_hash[request_id]
        for index in range(start, num_full):
            parent = hash_block(parent, token_ids[index * self.block_size : (index + 1) * self.block_size])
            self.pool.cache(table[index], parent)
        self._num_cached_blocks[request_id] = num_full
        self._last_hash[request_id] = parent

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool; unknown ids are ignored (abort is idempotent)."""
        table = self._tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self._last_hash.pop(request_id, None)
        if table is not None:
            self.pool.free(table)

    def rekey(self, request_id: str, owner: str) -> None:
        """Hand the request's table to another owner (a lease that offers its KV): the request's id is free
        from now on, and the blocks go back when `owner` is freed."""
        if owner in self._tables:
            raise RuntimeError(f"{owner} already holds blocks")
        self._tables[owner] = self._tables.pop(request_id)
        self._num_cached_blocks[owner] = self._num_cached_blocks.pop(request_id)
        self._last_hash[owner] = self._last_hash.pop(request_id)

    @property
    def num_requests(self) -> int:
        return len(self._tables)
