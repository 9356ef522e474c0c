"""Thin adapter over the NIXL binding (`nixl._bindings`), built with a progress-thread delay.

Why not `nixl._api.nixl_agent`: that wrapper hard-codes `nixlAgentConfig.pthrDelay = 0`, so the UCX
progress thread never sleeps and burns a whole core even when idle. The binding's own `nixlAgentConfig`
exposes `pthrDelay` (microseconds the thread waits between idle progress rounds), so this adapter builds
the agent from the binding directly and keeps only the calls this package needs. The thread itself must
stay on: without it, transfers whose target never calls into NIXL hang silently.
The binding raises on every NIXL error status; the calls made from a poll() (status, release, notifications,
send_notif) turn those into return values here, so no NIXL error reaches a worker's step loop.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kv_transfer.layout import KVLayout, MemoryRegion

logger = logging.getLogger(__name__)

XferStatus = str  # "DONE" | "PROC" | "ERR"


class NixlAgent:
    """One NIXL agent with the UCX backend, registered over one worker's KV memory."""

    def __init__(self, name: str, progress_delay_us: int, error_mode: str, cma_seg_size: str) -> None:
        """Args:
            name: agent name, unique among the agents that talk to each other (the worker id).
            progress_delay_us: idle wait of the progress thread; > 0 to keep it off the CPU.
            error_mode: UCX error handling, "peer" (detects dead peers) or "none".
            cma_seg_size: UCX_CMA_SEG_SIZE unless the environment sets it; "" keeps UCX's default.
        """
        if cma_seg_size:
            # UCX reads its configuration from the environment when the backend creates its context.
            os.environ.setdefault("UCX_CMA_SEG_SIZE", cma_seg_size)
        from nixl import _bindings as nixl_bind

        self._bind = nixl_bind
        config = nixl_bind.nixlAgentConfig(True)
        config.useProgThread = True
        config.useListenThread = False
        config.pthrDelay = progress_delay_us
        self.name = name
        self._agent = nixl_bind.nixlAgent(name, config)
        self._ucx = self._agent.createBackend("UCX", {"ucx_error_handling_mode": error_mode})
        self._registered: list[object] = []
        self._dlists: list[int] = []

    def _mem_type(self, layout: KVLayout) -> object:
        return self._bind.VRAM_SEG if layout.device == "cuda" else self._bind.DRAM_SEG

    def register(self, layout: KVLayout, regions: tuple[MemoryRegion, ...] | None = None) -> None:
        """Register memory of `layout`'s kind with UCX (pins it / creates its rkeys): `regions`, or the
        layout's own."""
        regions = layout.regions if regions is None else regions
        descs = [(r.address, r.num_bytes, r.device_id, "") for r in regions]
        reg = self._bind.nixlRegDList(self._mem_type(layout), descs)
        self._check(self._agent.registerMem(reg, [self._ucx]), "registerMem")
        self._registered.append(reg)

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory keys) for peers."""
        return bytes(self._agent.getLocalMD())

    def connection_info(self) -> bytes:
        """Just enough metadata for a peer to send this agent notifications (no memory keys): ~300 bytes."""
        no_memory = self._bind.nixlRegDList(self._bind.DRAM_SEG, [])
        return bytes(self._agent.getLocalPartialMD(no_memory, True, [self._ucx]))

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        name = self._agent.loadRemoteMD(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def prep_blocks(self, agent_name: str, layout: KVLayout) -> int:
        """Prepare once a descriptor list with one entry per block, so block id == descriptor index.

        Args:
            agent_name: the remote agent's name, or "" for this agent's own blocks.
            layout: the layout (ours or the peer's) whose blocks to describe.

        Returns:
            Prepared list handle for read().
        """
        # descs: [num_blocks, 3] = (address, length, device id); block i at row i.
        descs = np.empty((layout.num_blocks, 3), dtype=np.uint64)
        descs[:, 0] = [layout.block_address(i) for i in range(layout.num_blocks)]
        descs[:, 1] = layout.block_bytes
        descs[:, 2] = layout.regions[0].device_id
        dlist = self._bind.nixlXferDList(self._mem_type(layout), descs)
        target = agent_name or self._bind.NIXL_INIT_AGENT
        handle = int(self._agent.prepXferDlist(target, dlist, [self._ucx]))
        self._dlists.append(handle)
        return handle

    def forget_remote(self, agent_name: str, dlist: int | None) -> None:
        """A peer left: release its prepared list and drop its metadata (a re-add loads them anew)."""
        if dlist is not None and dlist in self._dlists:
            self._dlists.remove(dlist)
            try:
                self._agent.releasedDlistH(dlist)
            except Exception as exc:  # in use by a READ still posted: NIXL keeps it, we stop tracking it
                logger.warning("NIXL kept the descriptor list of %s: %s", agent_name, exc)
        try:
            self._agent.invalidateRemoteMD(agent_name)
        except Exception as exc:
            logger.warning("NIXL could not drop the metadata of %s: %s", agent_name, exc)

    def read(self, local_dlist: int, local_ids: tuple[int, ...], remote_dlist: int,
             remote_ids: tuple[int, ...], notif: bytes) -> tuple[int, XferStatus]:
        """Post a READ of remote blocks into local blocks; the peer gets `notif` when it completes.

        Returns:
            (transfer handle, status right after posting); the caller must release() the handle once.

        Raises:
            RuntimeError: the READ could not be made or posted (no handle is left to release then).
        """
        local_idx = np.asarray(local_ids, dtype=np.int32)
        remote_idx = np.asarray(remote_ids, dtype=np.int32)
        # NIXL merges descriptors that are adjacent on both sides, so runs of consecutive ids become one copy.
        try:
            xfer = int(self._agent.makeXferReq(self._bind.NIXL_READ, local_dlist, local_idx, remote_dlist,
                                               remote_idx, notif, [self._ucx]))
        except Exception as exc:
            raise RuntimeError(f"NIXL READ could not be made: {exc}") from exc
        try:
            return xfer, self._status(self._agent.postXferReq(xfer, notif))
        except Exception as exc:
            if not self.release(xfer):  # never posted, so nothing is in flight to refuse its release
                logger.error("NIXL transfer handle %#x of a READ that failed to post was not released", xfer)
            raise RuntimeError(f"NIXL READ could not be posted: {exc}") from exc

    def read_descriptors(self, layout: KVLayout, local: np.ndarray, agent_name: str, remote: np.ndarray
                         ) -> tuple[int, XferStatus]:
        """Post a READ of arbitrary descriptors ([n, 3] uint64: address, bytes, device id) of a peer's
        registered memory into this agent's (rank slices: kv_transfer/head_slices.py); no notification.

        Returns and raises as read().
        """
        mem_type = self._mem_type(layout)
        local_list = self._bind.nixlXferDList(mem_type, np.ascontiguousarray(local))
        remote_list = self._bind.nixlXferDList(mem_type, np.ascontiguousarray(remote))
        try:
            xfer = int(self._agent.createXferReq(self._bind.NIXL_READ, local_list, remote_list, agent_name,
                                                 "", [self._ucx]))
        except Exception as exc:
            raise RuntimeError(f"NIXL READ could not be made: {exc}") from exc
        try:
            return xfer, self._status(self._agent.postXferReq(xfer))
        except Exception as exc:
            if not self.release(xfer):
                logger.error("NIXL transfer handle %#x of a READ that failed to post was not released", xfer)
            raise RuntimeError(f"NIXL READ could not be posted: {exc}") from exc

    def status(self, xfer: int) -> XferStatus:
        """Non-blocking state of a posted transfer; "ERR" for any NIXL error."""
        try:
            return self._status(self._agent.getXferStatus(xfer))
        except Exception as exc:  # the binding raises on error statuses (peer gone, remote invalidated)
            logger.info("NIXL transfer %#x failed: %s", xfer, exc)
            return "ERR"

    def release(self, xfer: int) -> bool:
        """Free a transfer handle, cancelling it if still in flight.

        Returns:
            True once freed (never call again then); False if NIXL refused (it could not cancel a transfer
            still in flight): the handle stays valid, and the caller must try again later.
        """
        try:
            self._agent.releaseXferReq(xfer)
        except Exception as exc:  # NIXL_ERR_REPOST_ACTIVE and the like
            logger.debug("NIXL refused to release transfer handle %#x: %s", xfer, exc)
            return False
        return True

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sending agent name; empty if NIXL errs."""
        try:
            return dict(self._agent.getNotifs({}, [self._ucx]))
        except Exception as exc:
            logger.warning("NIXL notifications could not be read: %s", exc)
            return {}

    def send_notif(self, agent_name: str, message: bytes) -> bool:
        """Send a notification to a peer agent whose metadata (or connection info) was loaded.

        Returns:
            False if NIXL could not send it (unknown or disconnected peer); logged.
        """
        try:
            self._agent.genNotif(agent_name, message, [self._ucx])
        except Exception as exc:
            logger.warning("NIXL notification to %s could not be sent: %s", agent_name, exc)
            return False
        return True

    def close(self) -> None:
        """Release prepared lists and deregister memory (the agent is freed with this object)."""
        for handle in self._dlists:
            self._agent.releasedDlistH(handle)
        for reg in self._registered:
            self._agent.deregisterMem(reg, [self._ucx])
        self._dlists.clear()
        self._registered.clear()

    def _status(self, status: object) -> XferStatus:
        if status == self._bind.NIXL_SUCCESS:
            return "DONE"
        if status == self._bind.NIXL_IN_PROG:
            return "PROC"
        return "ERR"

    def _check(self, status: object, what: str) -> None:
        if status != self._bind.NIXL_SUCCESS:
            raise RuntimeError(f"NIXL {what} failed: {status}")
