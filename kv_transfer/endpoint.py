"""What both halves of a transfer hold: their worker id, their KV memory's layout, settings and records."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kv_transfer.config import TransferConfig
from kv_transfer.layout import layout_from_tensor
from kv_transfer.metrics import TransferRecorder

if TYPE_CHECKING:
    import torch


class TransferEndpoint:
    def __init__(
        self,
        worker_id: str,
        kv_cache: torch.Tensor,
        config: TransferConfig | None = None,
        recorder: TransferRecorder | None = None,
        ranks: Callable[..., list[Any]] | None = None,
    ) -> None:
        """Register `kv_cache` as the memory this half reads from (sender) or writes into (receiver).

        Args:
            worker_id: unique id of this worker (also its NIXL agent name).
            kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous.
            config: transfer settings; defaults to TransferConfig().
            recorder: where TransferRecords go; a private bounded one by default.
            ranks: rank 0 of a tensor-parallel worker whose ranks take part one by one (backends that
                declare reads_rank_slices): runs an op on every other rank, their answers in rank order
                (kv_transfer/backends/nixl_ranks.py); `kv_cache` is then rank 0's own.
        """
        self.worker_id = worker_id
        self.kv_cache = kv_cache
        self.layout = layout_from_tensor(kv_cache)
        self.config = config or TransferConfig()
        self.recorder = recorder or TransferRecorder(self.config.record_capacity)
        self.ranks = ranks
