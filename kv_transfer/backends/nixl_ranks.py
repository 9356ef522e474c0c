"""The other ranks of a tensor-parallel worker in NIXL transfers: each registers its own cache with an agent
of its own, is read by peers from there, and reads its own heads of a pull itself
(kv_transfer/head_slices.py).

Rank 0's NixlSender / NixlReceiver hold the lease, the claim and the grant as for a one-rank worker; they
reach the other ranks through a RankCall (the worker's step mirror: LLMEngine.call_ranks), which runs an op
on every other rank (and, meanwhile, a call of rank 0's own) and returns each one's answer, in rank order:
    OpenRank(config)      the rank's agent (made once, for the rank's life), its heads and memory → RankMemory
    LoadAgents / ForgetAgents    a receiver's peers: every source rank's agent metadata, loaded on every rank
    PostReads(key, ...)   plan the pull as rank 0 did, post this rank's reads (no notification) → bool
    PollReads()           {key: "PROC" | "DONE" | "ERR"} of the reads in flight; finished ones are released
                          (a DONE pull's heads read into the rank's scratch are in its cache by then)
    CancelReads(key)      stop them; True once none can write any more
A rank's own reads run on its agent's progress thread, so they move while the rank waits for rank 0's next
step. Rank 0 tells the sender PULLED only once every rank's reads are DONE.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kv_transfer.backends.nixl_agent import NixlAgent
from kv_transfer.backends.slice_reads import PullKey, SliceReads
from kv_transfer.config import TransferConfig
from kv_transfer.head_slices import plan_slice_reads
from kv_transfer.layout import KVLayout, MemoryRegion, layout_from_tensor

logger = logging.getLogger(__name__)

# An op on every other rank → their answers, in rank order; `meanwhile=` runs on rank 0 while they work.
RankCall = Callable[..., list[Any]]


@dataclass(frozen=True)
class OpenRank:
    config: TransferConfig


@dataclass(frozen=True)
class RankMemory:
    first_kv_head: int
    num_kv_heads: int
    region: MemoryRegion
    agent_metadata: bytes


@dataclass(frozen=True)
class LoadAgents:
    metadata: tuple[bytes, ...]


@dataclass(frozen=True)
class ForgetAgents:
    names: tuple[str, ...]


@dataclass(frozen=True)
class PostReads:
    key: PullKey
    src: KVLayout
    dst: KVLayout
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    src_agents: tuple[str, ...]  # the source ranks' agent names, in rank order


@dataclass(frozen=True)
class PollReads:
    pass


@dataclass(frozen=True)
class CancelReads:
    key: PullKey


_incarnations = itertools.count()


class RankTransfers:
    """A rank > 0's side: answers rank 0's ops over this rank's cache (the handler of its RankCalls)."""

    def __init__(self, worker_id: str, rank: int, first_kv_head: int, kv_cache: torch.Tensor) -> None:
        self.worker_id, self.rank, self.first_kv_head = worker_id, rank, first_kv_head
        self.layout = layout_from_tensor(kv_cache)
        self.kv_cache = kv_cache  # registered with the agent: kept alive with it
        self._reads: SliceReads | None = None
        self._loaded: dict[str, int] = {}  # peer agent name → how many LoadAgents named it

    def handle(self, op: object) -> object:
        if isinstance(op, OpenRank):
            return self._open(op.config)
        reads = self._started()
        if isinstance(op, LoadAgents):
            names = []
            for metadata in op.metadata:
                name = reads.agent.add_remote(metadata)
                self._loaded[name] = self._loaded.get(name, 0) + 1
                names.append(name)
            return tuple(names)
        if isinstance(op, ForgetAgents):
            for name in op.names:
                self._loaded[name] = self._loaded.get(name, 1) - 1
                if self._loaded[name] <= 0:
                    del self._loaded[name]
                    reads.agent.forget_remote(name, None)
            return None
        if isinstance(op, PostReads):
            plan = plan_slice_reads(op.src, op.dst, op.src_ids, op.dst_ids)
            return reads.post(op.key, [r for r in plan if r.dst.rank == self.rank], op.src_agents)
        if isinstance(op, PollReads):
            return reads.poll()
        if isinstance(op, CancelReads):
            return reads.cancel(op.key)
        raise TypeError(f"rank {self.rank}: unknown transfer op {op!r}")

    def _open(self, config: TransferConfig) -> RankMemory:
        if self._reads is None:  # once: peers keep this agent's metadata under its name
            agent = NixlAgent(f"{self.worker_id}.rank{self.rank}#{os.getpid()}.{next(_incarnations)}",
                              config.nixl_progress_delay_us, config.nixl_error_mode, config.ucx_cma_seg_size)
            agent.register(self.layout)
            self._reads = SliceReads(agent, self.kv_cache, config.rank_scratch_bytes)
        region = self.layout.regions[0]
        return RankMemory(self.first_kv_head, self.layout.num_kv_heads, region, self._reads.agent.metadata())

    def _started(self) -> SliceReads:
        if self._reads is None:
            raise RuntimeError(f"rank {self.rank}: a transfer op before OpenRank")
        return self._reads

    def close(self) -> None:
        if self._reads is not None:
            self._reads.cancel_all()
            self._reads.agent.close()
