"""The torch group's pair warm-up (kv_transfer/backends/torch_group.py warm_up_pairs): every pair of ranks
exchanges once, in an order that cannot deadlock, here over gloo with three real processes (NCCL, where the
warm-up is what keeps the first pull from deadlocking, needs GPUs: benchmarks/gpu_check.py)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from tests.helpers.child_processes import preloaded_context


def _rank(rank: int, world_size: int, init_file: str, results: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch.distributed as dist

    from kv_transfer.backends.torch_group import warm_up_pairs

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    warm_up_pairs(rank, world_size, "cpu")
    warm_up_pairs(rank, world_size, "cpu")  # twice: a rejoin after a restart warms up again
    dist.destroy_process_group()
    results.put(rank)


def test_every_pair_warms_up_without_deadlock(tmp_path: Path) -> None:
    context = preloaded_context()
    results = context.Queue()
    world_size = 3
    processes = [context.Process(target=_rank, args=(rank, world_size, str(tmp_path / "init"), results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=120)
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]
    assert sorted(results.get(timeout=5) for _ in range(world_size)) == [0, 1, 2]
