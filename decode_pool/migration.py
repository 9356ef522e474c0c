"""KV migration, sending side: a decode worker that hands its running streams back (it is changing role or
leaving) offers each stream's KV to whichever decode worker continues it, instead of making that worker
recompute prompt + tokens so far.

Lifecycle of one migrating stream on the worker that lets it go:
    offer(request) — the request has left the scheduler with its blocks (Scheduler.detach); the blocks
      holding its computed tokens are leased through this worker's own KV sender → the KVHandle rides on
      the request's last output (finish_reason "migrate") to the gateway, which gives it to the next worker
      → that worker pulls (or refuses, or fails: it recomputes and calls release()) → poll() reports the
      lease released (pulled, withdrawn, or expired) → the owner frees the blocks.
While any lease is out, the worker still holds work: a drain or role change waits for it
(load().num_requests).
Only the owner's step loop thread calls these methods (release() arrives through the worker's inbox).
"""

from __future__ import annotations

from kv_transfer import KVHandle, KVSender, PeerInfo
from llm_engine.kv_cache_manager import KVCacheManager, blocks_for
from llm_engine.request import Request


class MigrationOffers:
    def __init__(self, sender: KVSender, kv: KVCacheManager) -> None:
        self.sender = sender
        self._kv = kv
        self._offered: dict[int, str] = {}  # transfer_id → request id whose blocks the lease holds

    @property
    def num_outstanding(self) -> int:
        """Streams whose KV waits for its pull (their blocks are still held here)."""
        return len(self._offered)

    def peer_info(self) -> PeerInfo:
        """What another decode worker needs once to pull from this one."""
        return self.sender.peer_info()

    def offer(self, request: Request) -> KVHandle:
        """Lease the blocks holding the request's computed tokens (all but the last token, whose forward
        the next worker runs); the request must hold its table but be out of the scheduler."""
        table = self._kv.block_table(request.request_id)
        num_tokens = request.num_computed_tokens
        handle = self.sender.offer(table[:blocks_for(num_tokens, self._kv.block_size)], num_tokens)
        self._offered[handle.transfer_id] = request.request_id
        return handle

    def release(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer (the next worker refused it or failed, or the client left)."""
        released = self.sender.withdraw(transfer_id, why)
        if released is not None:
            self._free(released.transfer_id)

    def poll(self) -> None:
        """Answer the pulling workers (NIXL claims) and free the blocks of every lease that ended."""
        for released in self.sender.poll():
            self._free(released.transfer_id)

    def _free(self, transfer_id: int) -> None:
        request_id = self._offered.pop(transfer_id, None)
        if request_id is not None:
            self._kv.free(request_id)

    def close(self) -> None:
        self.sender.close()
