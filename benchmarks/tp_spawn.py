"""The other ranks of a tensor-parallel engine as spawned processes, for the benchmarks that run one
(tp_steps.py, tp_handoff.py): the group's address bound by rank 0 first, then ranks 1..size-1 started."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import Any


def start_other_ranks(config: Any, follow: Callable[..., None], extra: object) -> tuple[Any, list[Any]]:
    """Rank 0's TPGroup (joined once the engine is built over it) and the processes of ranks 1..size-1,
    each running follow(config, rank, size, init_method, extra)."""
    from llm_engine.tensor_parallel import TPGroup, TPRank, bind_group_address

    size = config.tensor_parallel_size
    init = bind_group_address("127.0.0.1", size)
    context = mp.get_context("spawn")
    processes = [context.Process(target=follow, args=(config, r, size, init, extra), daemon=True)
                 for r in range(1, size)]
    for process in processes:
        process.start()
    return TPGroup(TPRank(0, size, init)), processes
