"""A pool of fixed-size KV blocks with reference counts and a hash-addressed prefix cache.

Block lifecycle:
    FREE (in the free queue, maybe still holding a cached hash)
      → allocate() or touch() → IN USE (ref_count ≥ 1; shared prefix blocks have ref_count > 1)
      → free() down to ref_count 0 → FREE again, appended at the tail of the free queue.
A free block that still carries a hash can be revived by a later request with the same prefix (touch());
allocate() takes blocks from the head of the queue, so the least recently freed cached blocks are evicted
first (LRU) and their hash is forgotten at that moment.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Hash of the block's token ids chained with its predecessor's hash; None until the block is full.
    block_hash: bytes | None = None


class BlockPool:
    """Owns block ids 0..num_blocks-1; knows nothing of requests or tensors."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = eviction order: head is the least recently freed block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_free_calls = 0  # grows whenever blocks may have been freed: "has anything changed?"

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks with ref_count 1, evicting cached prefixes least-recently-freed first."""
        if not self.can_allocate(num_blocks):
            raise RuntimeError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding this prefix hash, whether in use or free-but-cached, else None."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (prefix sharing); revives free cached blocks."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Record that a full, in-use block holds the prefix `block_hash` so later requests can share it."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            raise RuntimeError(f"block {block_id} is free; only blocks in use can be cached")
        if block.block_hash is not None or block_hash in self._cached:
            return  # already cached here, or another block already holds this prefix
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching zero go to the tail of the free queue.

        Blocks are freed in reverse so that a request's last (least shareable) blocks are evicted first.
        """
        self.num_free_calls += 1
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def is_whole(self) -> bool:
        """True when every block is free with no reference left: nothing leaked."""
        return len(self._free) == self.num_blocks and all(b.ref_count == 0 for b in self.blocks)

    def reset_prefix_cache(self) -> None:
        for block_id in self._cached.values():
            self.blocks[block_id].block_hash = None
        self._cached.clear()
