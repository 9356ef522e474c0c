"""Process setup shared by every worker process (CPU threads and the cores they run on, torch.distributed).

Cores: a worker is given a slot on its node (0, 1, ... among the node's live workers) and pins every thread
of its process to cores [slot × threads, (slot + 1) × threads) of the cores it may use (wrapping round when
the workers' threads outnumber them), so that two workers never fight over one core: on 2 cores an unpinned
pair of workers measured slower steps from the kernel migrating their threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

GIL_SLICE_S = 0.0005  # sys.setswitchinterval in worker processes (CPython's default: 0.005)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchGroupSpec:
    """Where a worker joins the torch.distributed group (only for the torch transfer backend)."""

    init_method: str  # e.g. "tcp://127.0.0.1:29500"
    rank: int
    world_size: int
    backend: str = "gloo"  # "nccl" on GPU clusters


def cores_for_slot(slot: int, num_threads: int, allowed: list[int]) -> tuple[int, ...]:
    """The cores a worker in `slot` with `num_threads` threads runs on, from the node's `allowed` cores."""
    return tuple(sorted({allowed[(slot * num_threads + i) % len(allowed)] for i in range(num_threads)}))


def pin_process(cores: tuple[int, ...]) -> None:
    """Every thread of this process (Ray's, NIXL's, torch's) on `cores`; threads started later inherit it."""
    tasks = Path("/proc/self/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]:
        # A thread that ended meanwhile, or one the process may not move: the rest are still pinned.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(tid, cores)


def setup_worker_process(num_threads: int, group: TorchGroupSpec | None = None,
                         cpu_slot: int | None = None) -> tuple[int, ...]:
    """Set the torch threads, pin the process to its slot's cores (None: not pinned), and join the torch
    group. Returns the cores the process may run on."""
    import torch  # here: the gateway imports TorchGroupSpec, and has no torch

    if num_threads < 1:
        raise ValueError(f"threads per worker must be >= 1, got {num_threads}")
    torch.set_num_threads(num_threads)
    if cpu_slot is not None and hasattr(os, "sched_setaffinity"):
        pin_process(cores_for_slot(cpu_slot, num_threads, sorted(os.sched_getaffinity(0))))
    # The step loop thread runs the model's Python between torch ops and holds the GIL for 5 ms slices by
    # default; the actor's event loop (replies, output streams, pull hops) then waits up to a slice for
    # each hand-over, which under load adds up to hundreds of ms per request. A shorter slice costs the
    # forward little.
    sys.setswitchinterval(GIL_SLICE_S)
    if group is not None:
        import torch.distributed as dist

        dist.init_process_group(group.backend, init_method=group.init_method, rank=group.rank,
                                world_size=group.world_size)
        if group.backend == "nccl":  # NCCL connects pairs lazily: the first pull would deadlock
            from kv_transfer.backends.torch_group import warm_up_pairs

            warm_up_pairs(group.rank, group.world_size, torch.device("cuda", torch.cuda.current_device()))
        logger.info("joined torch.distributed group as rank %d of %d", group.rank, group.world_size)
    return tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
