"""The other ranks of a tensor-parallel worker: a Ray actor each, on the worker's node, owned by the worker's
actor (rank 0), so that they end when it ends.

Lifecycle (driven by WorkerActor.start when tensor_parallel_size > 1):
    TPRanks.create(worker_id, size, ...) → ranks 1..size-1 (TPRankActor), each in its bundle of the worker's
        placement group (one bundle per rank on one node, made with the worker: gateway/fleet/rank_groups.py),
        with its own CPUs and GPU; an actor made without one (a library user's) pins the ranks to its node
        and shares what it holds (on CUDA: the GPU id rank 0 was given for each, as its CUDA_VISIBLE_DEVICES)
    → rank 0 picks a free port on its node; each rank's start() joins the group there, loads its slice of
        the model and waits for the cache size (llm_engine/tp_follower.py), while rank 0 builds its
        LLMEngine over the same group (which sends the size) → TPRanks.wait_started()
    → each rank replays rank 0's steps on a thread of its own (TPFollower.serve), and, where the transfer
      backend reads each rank's heads where they live (NIXL), answers rank 0's transfer ops over its cache
      (kv_transfer/backends/nixl_ranks.py RankTransfers)
    → a rank that dies: rank 0's next all-reduce fails, its step loop fails the worker, and the gateway
      replaces it as any failed worker (the other ranks go with rank 0's actor). An idle worker has no
      all-reduce to fail: each rank's `ended()` call, pending while it serves, resolves when it dies, and
      rank 0's load() fails the worker on it (TPRanks.ended; review P7). Rank 0 that dies: Ray ends the
      ranks it owns.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import replace
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from kv_transfer.backends.nixl_ranks import RankTransfers
from llm_engine.config import EngineConfig
from llm_engine.tensor_parallel import TPGroup, TPRank
from llm_engine.tp_follower import TPFollower
from worker_runtime.worker_setup import setup_worker_process

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0  # the ranks ask for nothing, on rank 0's node: only a process start to wait for


class TPRankActor:
    """Rank > 0 of one worker: its slice of the model, stepping with rank 0."""

    def __init__(self, worker_id: str, rank: int) -> None:
        self.worker_id, self.rank = worker_id, rank
        self._follower: TPFollower | None = None
        self._replay: threading.Thread | None = None

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def start(self, tp: TPRank, engine_config: EngineConfig, model_dir: str, num_threads: int) -> int:
        """Join the group, load this rank's slice, allocate its cache as rank 0 says, and start replaying.
        Returns this process's id."""
        setup_worker_process(num_threads)
        self._follower = TPFollower(replace(engine_config, model_dir=model_dir), TPGroup(tp))
        if not engine_config.tp_staging:  # the transfer layer reads and writes this rank's heads here
            transfers = RankTransfers(self.worker_id, self.rank, self._follower.first_kv_head,
                                      self._follower.runner.kv_cache)
            self._follower.rank_handler = transfers.handle
        self._replay = threading.Thread(target=self._serve, name=f"tp-rank-{self.rank}", daemon=True)
        self._replay.start()
        return os.getpid()

    def ended(self) -> None:
        """Returns once this rank stops replaying (rank 0 sent Stop); if the rank dies first, the call fails
        with Ray's actor-died error: either way rank 0 sees that the rank is gone."""
        if self._replay is not None:
            self._replay.join()

    def num_steps(self) -> int:
        return 0 if self._follower is None else self._follower.num_steps

    def _serve(self) -> None:
        assert self._follower is not None
        try:
            self._follower.serve()
        except Exception:  # rank 0 is gone, or a step failed here: this rank is of no use to anyone now
            logger.exception("%s rank %d: replaying rank 0's steps failed; the rank ends", self.worker_id,
                             self.rank)
            os._exit(1)


class TPRanks:
    """Rank 0's handles on its other ranks."""

    def __init__(self, actors: list[Any], start_refs: list[Any]) -> None:
        self.actors = actors
        self._start_refs = start_refs
        self._ended_refs: list[Any] = []  # one pending `ended()` call per rank, once all have started
        self.pids: list[int] = []

    @classmethod
    def create(cls, worker_id: str, tp: TPRank, engine_config: EngineConfig, model_dir: str, num_threads: int,
               node_id: str, gpu_ids: list[str]) -> TPRanks:
        """Ranks 1..tp.size-1 on node `node_id`, each starting (joining the group at tp.init_method): in the
        bundles of the worker's placement group (gateway/fleet/rank_groups.py), each rank with its own CPUs
        and GPU; or, for an actor made without one, pinned to rank 0's node, sharing what rank 0 holds.

        Args:
            gpu_ids: without a placement group, the GPUs Ray gave rank 0's actor, one per rank (rank 0 runs
                on the first); [] on a CPU.

        Raises:
            RuntimeError: a rank was not placed in PLACEMENT_TIMEOUT_S.
        """
        group = get_current_placement_group()
        actors: list[Any] = []
        for rank in range(1, tp.size):
            options: dict[str, Any] = {"max_concurrency": 4, "name": f"pdserve-{worker_id}-rank{rank}"}
            if group is not None and group.bundle_count == tp.size:  # the worker's group: a bundle per rank
                held = ray.get_runtime_context().get_assigned_resources()  # rank 0's, as each rank's
                options |= {"num_cpus": held.get("CPU", 0.0), "num_gpus": held.get("GPU", 0.0),
                            "scheduling_strategy": PlacementGroupSchedulingStrategy(group, rank)}
            else:  # rank 0 holds the whole group's resources: each rank takes its share of them
                options |= {"num_cpus": 0, "num_gpus": 0,
                            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False)}
                if gpu_ids:
                    options["runtime_env"] = {"env_vars": {"CUDA_VISIBLE_DEVICES": str(gpu_ids[rank])}}
            actors.append(ray.remote(TPRankActor).options(**options).remote(worker_id, rank))
        placed = [actor.node_id.remote() for actor in actors]
        ready, _ = ray.wait(placed, num_returns=len(placed), timeout=PLACEMENT_TIMEOUT_S)
        if len(ready) < len(placed):
            for actor in actors:
                ray.kill(actor)
            raise RuntimeError(
                f"{worker_id}: {len(placed) - len(ready)} of its {tp.size - 1} other tensor-parallel ranks "
                f"did not start on its node {node_id[:12]} in {PLACEMENT_TIMEOUT_S:g} s")
        refs = [actor.start.remote(replace(tp, rank=rank), engine_config, model_dir, num_threads)
                for rank, actor in enumerate(actors, start=1)]
        return cls(actors, refs)

    def wait_started(self, timeout_s: float) -> None:
        """Every rank loaded and allocated its cache (rank 0's engine has sent the size).

        Raises:
            RuntimeError: a rank failed to start, or did not within `timeout_s`.
        """
        ready, _ = ray.wait(self._start_refs, num_returns=len(self._start_refs), timeout=timeout_s)
        if len(ready) < len(self._start_refs):
            raise RuntimeError(f"{len(self._start_refs) - len(ready)} tensor-parallel ranks did not start in "
                               f"{timeout_s:g} s")
        self.pids = ray.get(ready)
        self._ended_refs = [actor.ended.remote() for actor in self.actors]

    def ended(self) -> list[int]:
        """The ranks that are gone (died, or stopped replaying): a look at the pending `ended()` calls that
        waits for nothing."""
        if not self._ended_refs:
            return []
        done, _ = ray.wait(self._ended_refs, num_returns=len(self._ended_refs), timeout=0)
        return [rank for rank, ref in enumerate(self._ended_refs, start=1) if ref in done]

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
