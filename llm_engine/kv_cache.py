"""The paged KV cache tensor: its layout and size per token and per block (how many blocks a worker gets is
llm_engine/kv_sizing.py's).

Layout: one contiguous tensor [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim] (an int8
cache's heads a few elements wider: their scales, llm_engine/kv_dtype.py).
Block-major across layers, so block i is the single byte range [i*block_bytes, (i+1)*block_bytes): a
request's KV is a handful of contiguous regions, which is what the transfer layer moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.kv_dtype import kv_cache_torch_dtype, stored_head_dim
from llm_engine.rank_shares import spec_shares


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: torch.dtype

    @classmethod
    def from_model(cls, spec: ModelSpec, config: EngineConfig, rank: int = 0) -> KVCacheSpec:
        """One rank's cache: with tensor parallelism each rank holds its own KV heads only (rank 0 the most,
        where they do not divide evenly: llm_engine/rank_shares.py)."""
        num_kv_heads = spec.num_kv_heads
        if config.tensor_parallel_size > 1:
            num_kv_heads = spec_shares(spec, config.tensor_parallel_size)[rank].num_kv_heads
        return cls(spec.num_layers, num_kv_heads, spec.head_dim, config.block_size,
                   kv_cache_torch_dtype(config.kv_cache_dtype, config.torch_dtype))

    @property
    def dtype_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def stored_head_dim(self) -> int:
        """Elements a head takes in a cache row: head_dim, and an int8 cache's scale (kv_dtype.py)."""
        return stored_head_dim(self.dtype, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) × layers × kv heads × stored head dim × dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.stored_head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        # zeros, not empty: unwritten slots are masked out anyway, but NaN garbage there would poison
        # a masked softmax row's matmul (0 * NaN = NaN).
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.stored_head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)
