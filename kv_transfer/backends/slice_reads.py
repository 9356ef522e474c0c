"""The READs one rank of a tensor-parallel receiver has in flight, by pull (kv_transfer/head_slices.py plans
them): rank 0's NixlReceiver keeps one SliceReads for its own heads, every other rank one in its RankTransfers
(kv_transfer/backends/nixl_ranks.py).

    post(key, reads)  whole-block READs where both ranks hold the same heads in the same type; else the
                      source's whole blocks into the scratch (whole, or range by range through a slot of
                      it), or, with no slot free, one descriptor per row straight into the cache (a read that
                      converts its elements fails then: only the scratch takes the source's type)
    poll()            {key: PROC | DONE | ERR}; a staged range, once read, is copied into the cache and the
                      next range read into the same slot; DONE is reported once, the pull then forgotten
    cancel(key)       stop the READs, free the scratch; False while NIXL refuses a release
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kv_transfer.backends.nixl_agent import NixlAgent, XferStatus
from kv_transfer.head_slices import SliceRead
from kv_transfer.layout import MemoryRegion, layout_from_tensor

logger = logging.getLogger(__name__)

PullKey = tuple[str, int]  # (source worker id, transfer id), as the receiver's

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
                if staging is None and read.converts:  # the cache cannot take the source's bytes
                    raise RuntimeError("no room in the scratch to stage a read that converts its elements "
                                       f"({self._scratch_bytes} bytes, all taken)")
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
