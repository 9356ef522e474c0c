"""A rank > 0 of a tensor-parallel worker: its slice of the model and KV cache, stepping with rank 0.

    TPFollower(config, group): load this rank's slice (llm_engine/model_loader.py) → wait for rank 0's cache
        size (StartFollowers) → allocate as many blocks of this rank's KV heads
    → serve(): replay each call rank 0's runner mirrors (execute, copy_blocks, forget_all, and the gather and
      scatter of blocks that leave or arrive), and answer rank 0's RankCalls through rank_handler (the NIXL
      transfer layer's ops on this rank's cache: kv_transfer/backends/nixl_ranks.py), until Stop.
No scheduler and no sampling here: rank 0 decides every step (llm_engine/tensor_parallel.py says why).
"""

from __future__ import annotations

from collections.abc import Callable

from llm_engine.config import EngineConfig
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.model_loader import LoadedModel, load_model
from llm_engine.model_runner import ModelRunner
from llm_engine.node_locks import node_memory_lock
from llm_engine.rank_shares import spec_shares
from llm_engine.tensor_parallel import RankCall, RankCallFailed, StartFollowers, StepMirror, Stop, TPGroup


class TPFollower:
    def __init__(self, config: EngineConfig, group: TPGroup, loaded: LoadedModel | None = None) -> None:
        if group.rank == 0:
            raise ValueError("rank 0 of a tensor-parallel group runs the LLMEngine, not a follower")
        loaded = loaded or load_model(config, group)
        self.spec = loaded.spec.with_max_model_len(config.max_model_len)
        self.mirror = StepMirror(group)
        start = self.mirror.receive()
        if not isinstance(start, StartFollowers):
            raise RuntimeError(f"rank {group.rank}: rank 0 sent {start!r} before the cache size")
        with node_memory_lock(config.device):
            kv_cache = KVCacheSpec.from_model(self.spec, config, group.rank).allocate(start.num_blocks,
                                                                                      config.device)
        self.runner = ModelRunner(loaded.model, self.spec, config, start.num_blocks, loaded.body, kv_cache,
                                  compilation=loaded.compilation)
        self.runner.tp_group = group
        self.group = group
        self.num_steps = 0
        # Answers rank 0's RankCalls (the transfer layer's ops, installed by the worker); None: refused.
        self.rank_handler: Callable[[object], object] | None = None

    @property
    def first_kv_head(self) -> int:
        return spec_shares(self.spec, self.group.size)[self.group.rank].kv_start

    def serve(self) -> None:
        """Replay rank 0's calls until it sends Stop (or a collective fails: rank 0 is gone)."""
        while True:
            call = self.mirror.receive()
            if isinstance(call, Stop):
                return
            if isinstance(call, StartFollowers):
                raise RuntimeError("rank 0 sent a second cache size")
            if isinstance(call, RankCall):
                self.group.gather_objects(self._answer(call.op))
                continue
            self.runner.replay(call)
            self.num_steps += 1

    def _answer(self, op: object) -> object:
        """The handler's answer, or what went wrong: rank 0 waits in the gather either way."""
        if self.rank_handler is None:
            return RankCallFailed("no handler for rank calls on this rank")
        try:
            return self.rank_handler(op)
        except Exception as exc:
            return RankCallFailed(f"{type(exc).__name__}: {exc}")
