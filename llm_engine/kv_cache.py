"""The paged KV cache tensor: its layout, and how many blocks a memory budget buys.

Layout: one contiguous tensor [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim].
Block-major across layers, so block i is the single byte range [i*block_bytes, (i+1)*block_bytes): a
request's KV is a handful of contiguous regions, which is what the transfer layer moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llm_engine.config import EngineConfig, ModelSpec


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per block
    dtype: torch.dtype

    @classmethod
    def from_model(cls, spec: ModelSpec, config: EngineConfig) -> KVCacheSpec:
        return cls(spec.num_layers, spec.num_kv_heads, spec.head_dim, config.block_size, config.torch_dtype)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) × layers × kv heads × head dim × dtype bytes."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, budget_bytes: int) -> int:
        """Blocks that fit in `budget_bytes`.

        Raises:
            ValueError: the budget does not hold even one block.
        """
        num_blocks = budget_bytes // self.block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"a KV budget of {budget_bytes} bytes holds no block of {self.block_bytes} bytes "
                f"({self.block_size} tokens × {self.bytes_per_token} bytes/token)"
            )
        return num_blocks

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        # zeros, not empty: unwritten slots are masked out anyway, but NaN garbage there would poison
        # a masked softmax row's matmul (0 * NaN = NaN).
        shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=device)
