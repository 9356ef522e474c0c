"""Process setup shared by every worker process (CPU threads, torch.distributed group)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

GIL_SLICE_S = 0.0005  # sys.setswitchinterval in worker processes (CPython's default: 0.005)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchGroupSpec:
    """Where a worker joins the torch.distributed group (only for the torch transfer backend)."""

    init_method: str  # e.g. "tcp://127.0.0.1:29500"
    rank: int
    world_size: int
    backend: str = "gloo"  # "nccl" on GPU clusters


def setup_worker_process(num_threads: int, group: TorchGroupSpec | None = None) -> None:
    """One torch thread per worker by default: on 2 cores more threads only fight each other."""
    torch.set_num_threads(num_threads)
    # The step loop thread runs the model's Python between torch ops and holds the GIL for 5 ms slices by
    # default; the actor's event loop (replies, output streams, pull hops) then waits up to a slice for
    # each hand-over, which under load adds up to hundreds of ms per request. A shorter slice costs the
    # forward little.
    sys.setswitchinterval(GIL_SLICE_S)
    if group is not None:
        import torch.distributed as dist

        dist.init_process_group(group.backend, init_method=group.init_method, rank=group.rank,
                                world_size=group.world_size)
        logger.info("joined torch.distributed group as rank %d of %d", group.rank, group.world_size)
