"""Plain child processes for the engine-level tests that need several (tensor-parallel ranks, a torch group):
forked from multiprocessing's fork server, which imported torch and the engine once, instead of spawned
(each spawned child imports them again: 2–3 CPU-s a child, about 20 children in
tests/engine/test_tensor_parallel.py).

Forking is safe here where forking the test process is not: the fork server is a fresh process that
multiprocessing starts (spawns) on first use, with no thread and no Ray; importing torch starts no thread
pool. A child gets the environment the fork server started with, not the test process's of the moment:
the callers here need none of what fixtures set later (UCX's devices, for one), so the KV transfer peers,
which do, are still spawned (tests/kv_transfer/kvx_harness.py)."""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import ForkServerContext

# What every child needs: torch, the engine and its tensor-parallel group (this module's callers' imports).
PRELOADED = ["torch", "torch.distributed", "llm_engine.engine", "llm_engine.tp_follower",
             "kv_transfer.backends.torch_group", "tests.helpers.tp_ranks"]


def preloaded_context() -> ForkServerContext:
    """multiprocessing's fork-server context, its server importing PRELOADED once when it first starts."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)
    return context
