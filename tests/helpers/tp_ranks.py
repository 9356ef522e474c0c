"""The other ranks of a tensor-parallel engine as plain processes (forked from a fork server that imported the
engine once: tests/helpers/child_processes.py), as a worker's Ray actors would be: for the engine-level
tests, which need no Ray."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from llm_engine import EngineConfig
from llm_engine.tensor_parallel import TPGroup, TPRank, bind_group_address
from tests.helpers.child_processes import preloaded_context


def _follow(config: EngineConfig, tp: TPRank) -> None:
    import torch

    from llm_engine.tp_follower import TPFollower

    torch.set_num_threads(1)
    TPFollower(config, TPGroup(tp)).serve()


@contextlib.contextmanager
def other_ranks(config: EngineConfig) -> Iterator[tuple[TPRank, list[Any]]]:
    """Ranks 1..size-1 of `config` started (each loads its slice and waits for rank 0); yields rank 0's
    TPRank and the processes. The processes are ended on exit."""
    size = config.tensor_parallel_size
    tp = TPRank(0, size, bind_group_address("127.0.0.1", size))
    context = preloaded_context()  # not a fork of the test process: it holds threads (and maybe Ray)
    processes = [context.Process(target=_follow, args=(config, TPRank(rank, size, tp.init_method)),
                                 daemon=True) for rank in range(1, size)]
    for process in processes:
        process.start()
    try:
        yield tp, processes
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
