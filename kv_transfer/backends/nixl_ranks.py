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
from dataclasses import dataclass, field
from typing import Any

import torch

from kv_transfer.backends.nixl_agent import NixlAgent, XferStatus
from kv_transfer.config import TransferConfig
from kv_transfer.head_slices import SliceRead, plan_slice_reads
from kv_transfer.layout import KVLayout, MemoryRegion, layout_from_tensor

logger = logging.getLogger(__name__)

PullKey = tuple[str, int]  # (source worker id, transfer id), as the receiver's
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


# A staged read that the scratch cannot take whole goes through a slot of at most this share of it, range
# by range: a long prompt's pull never falls back to one descriptor per block row (review P6), and four such
# pulls stage side by side.
SLOT_SHARE = 4


@dataclass
class _Staging:
    """One staged read through a slot of the scratch, a range of its blocks at a time (internal)."""

    offset: int  # the slot's first byte in the scratch
    source: str  # the source rank's agent name
    ranges: list[SliceRead]  # the ranges still to read, in order; ranges[0] is the one in flight
    handle: int | None = None  # the READ of ranges[0] (None: none posted yet, or all done)
    is_copied: bool = False  # ranges[0]'s heads are in the cache (its handle's release is still to come)


@dataclass
class _Posted:
    """One pull's READs on one rank (internal)."""

    handles: list[int] = field(default_factory=list)  # whole-block and row READs not yet released
    staged: list[_Staging] = field(default_factory=list)  # reads through the scratch
    failed: bool = False  # a READ failed: ERR until the pull is cancelled
    is_reported: bool = False  # DONE was reported once (a release NIXL refused keeps the entry a while)


class SliceReads:
    """The READs one rank has in flight, by pull: rank 0's receiver keeps one for its own heads, every other
    rank one in its RankTransfers. Reads between ranks whose heads differ go through a scratch buffer of
    `scratch_bytes` (registered at first use): whole where it has room, else range by range through a slot of
    it; straight into the cache, one descriptor per row, only when no slot is free
    (kv_transfer/head_slices.py says why)."""

    def __init__(self, agent: NixlAgent, cache: torch.Tensor, scratch_bytes: int) -> None:
        self.agent, self.cache = agent, cache
        self.layout = layout_from_tensor(cache)
        self._scratch_bytes = scratch_bytes
        self._scratch: torch.Tensor | None = None
        self._taken: dict[int, int] = {}  # scratch offset -> bytes, of reads in flight
        self._posted: dict[PullKey, _Posted] = {}
        self._device_id = self.layout.regions[0].device_id

    def post(self, key: PullKey, reads: list[SliceRead], src_agents: tuple[str, ...]) -> bool:
        """Post every read (a staged one's first range); False (and nothing left in flight) if one could
        not be posted."""
        posted = self._posted[key] = _Posted()
        try:
            for read in reads:
                source = src_agents[read.src.rank]
                staging = None if read.same_heads else self._slot(read, source)
                if staging is None:
                    local, remote = read.direct()
                    posted.handles.append(self.agent.read_descriptors(self.layout, local, source, remote)[0])
                else:
                    posted.staged.append(staging)
                    self._advance(staging)
        except RuntimeError as exc:
            logger.warning("rank reads of transfer %s could not be posted: %s", key, exc)
            self.cancel(key)
            return False
        return True

    def poll(self) -> dict[PullKey, XferStatus]:
        """Each pull's state: DONE once every read is (staged heads copied into the cache range by range:
        reported once, the pull then forgotten), ERR once one failed (until cancel())."""
        states: dict[PullKey, XferStatus] = {}
        for key, posted in list(self._posted.items()):
            statuses = [self.agent.status(h) for h in posted.handles]
            if not posted.failed and "ERR" not in statuses:
                try:
                    statuses += [self._advance(staging) for staging in posted.staged]
                except RuntimeError as exc:  # the next range's READ could not be posted
                    logger.warning("rank reads of transfer %s: %s", key, exc)
                    statuses.append("ERR")
            if posted.failed or "ERR" in statuses:
                posted.failed = True
                states[key] = "ERR"
            elif all(s == "DONE" for s in statuses):
                if not posted.is_reported:
                    states[key], posted.is_reported = "DONE", True
                self.cancel(key)  # again at each poll while NIXL refuses a release
            else:
                states[key] = "PROC"
        return states

    def cancel(self, key: PullKey) -> bool:
        """Release the pull's handles (cancelling reads in flight) and its scratch; False while NIXL refuses
        one (the scratch stays taken until then)."""
        posted = self._posted.get(key)
        if posted is None:
            return True
        posted.handles[:] = [h for h in posted.handles if not self.agent.release(h)]
        for staging in posted.staged:
            staging.ranges.clear()  # nothing more is posted
            if staging.handle is not None and self.agent.release(staging.handle):
                staging.handle = None
        if posted.handles or any(staging.handle is not None for staging in posted.staged):
            return False
        for staging in posted.staged:
            del self._taken[staging.offset]
        del self._posted[key]
        return True

    def cancel_all(self) -> None:
        for key in list(self._posted):
            if not self.cancel(key):
                logger.error("closing with NIXL reads of %s that could not be cancelled", key)

    def _slot(self, read: SliceRead, source: str) -> _Staging | None:
        """Scratch for the whole read, else for ranges of it (a slot of up to 1/SLOT_SHARE of the
        scratch, at least one block); None if neither is free."""
        offset = self._take(read.staged_bytes)
        if offset is not None:
            return _Staging(offset, source, [read])
        max_blocks = max(1, self._scratch_bytes // SLOT_SHARE // read.src_block_bytes)
        if max_blocks >= len(read.src_ids):
            return None  # the whole read is no larger than a slot, which had no room either
        offset = self._take(max_blocks * read.src_block_bytes)
        if offset is None:
            return None
        return _Staging(offset, source, read.split(max_blocks))

    def _advance(self, staging: _Staging) -> XferStatus:
        """Move a staged read on: its range in flight, once DONE, is copied into the cache and released,
        then the next range is posted into the same slot. "DONE" once every range is copied.

        Raises:
            RuntimeError: a range's READ could not be posted.
        """
        assert self._scratch is not None
        if staging.handle is not None:
            if not staging.is_copied:
                status = self.agent.status(staging.handle)
                if status != "DONE":
                    return status
                staging.ranges[0].copy_staged(self._scratch[staging.offset:], self.cache)
                staging.is_copied = True
            if not self.agent.release(staging.handle):
                return "PROC"  # asked again at the next poll; its heads are not copied twice
            staging.handle = None
            staging.ranges.pop(0)
        if not staging.ranges:
            return "DONE"
        local, remote = staging.ranges[0].staged(self._scratch.data_ptr() + staging.offset, self._device_id)
        staging.handle = self.agent.read_descriptors(self.layout, local, staging.source, remote)[0]
        staging.is_copied = False
        return "PROC"

    def _take(self, num_bytes: int) -> int | None:
        """First fit in the scratch (made and registered at first use); None if it has no room."""
        if num_bytes > self._scratch_bytes:
            return None
        if self._scratch is None:
            self._scratch = torch.empty(self._scratch_bytes, dtype=torch.uint8, device=self.cache.device)
            self.agent.register(self.layout, (MemoryRegion(self._scratch.data_ptr(), self._scratch_bytes,
                                                           self._device_id, 0),))
        start = 0
        for offset, size in sorted(self._taken.items()):
            if offset - start >= num_bytes:
                break
            start = -(-(offset + size) // 256) * 256  # aligned for any element type
        if start + num_bytes > self._scratch_bytes:
            return None
        self._taken[start] = num_bytes
        return start


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
