"""KV migration, sending side: a decode worker that hands running streams back (it is changing role or
leaving, or the gateway moves them away from a long prompt) offers each stream's KV to whichever decode
worker continues it, instead of making that worker recompute prompt + tokens so far.

Lifecycle of one migrating stream on the worker that lets it go:
    offer(request) — the request has left the scheduler with its blocks (Scheduler.detach); the blocks
      holding its computed tokens are leased through this worker's own KV sender → the KVHandle rides on
      the request's last output (finish_reason "migrate") to the gateway, which gives it to the next worker
      → that worker pulls (or refuses, or fails: it recomputes and calls release()) → the sender sees the
      lease released (pulled, withdrawn, or expired) → the owner frees the blocks at its next poll().
Who polls the sender: the step loop (poll(), between forwards) and, with start_polling(), a thread of its
own while leases are out, so that the next worker's claim is answered within a millisecond, not after this
worker's forward (a long prompt's chunk beside the moved streams would otherwise hold their pull for a
second). Every call on the sender holds `_lock`; blocks are freed only by the loop thread (poll()).
While any lease is out, the worker still holds work: a drain or role change waits for it
(load().num_requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kv_transfer import KVHandle, KVSender, PeerInfo, ReleasedBlocks
from llm_engine.kv_cache_manager import KVCacheManager, blocks_for
from llm_engine.request import Request

POLL_S = 0.001  # the polling thread's period while a lease is out or a claim may still come
IDLE_WAIT_S = 0.05  # with nothing out, the thread looks again this often (a safety net: offer() wakes it)


class MigrationOffers:
    def __init__(self, sender: KVSender, kv: KVCacheManager,
                 export: Callable[[Sequence[int]], None] | None = None) -> None:
        """Args:
            export: makes blocks whole in the sender's cache before they are offered (LLMEngine.export_blocks:
                a tensor-parallel worker gathers its ranks' heads); None: they are.
        """
        self.sender = sender
        self._kv = kv
        self._export = export
        self._offered: dict[int, str] = {}  # transfer_id → the lease's key of its blocks in the KV manager
        self._lock = threading.Lock()  # every call on the sender
        self._released: list[ReleasedBlocks] = []  # seen by the polling thread, freed by poll()
        self._has_offers = threading.Event()
        self._is_stopped = False
        self._thread: threading.Thread | None = None

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
        blocks = table[:blocks_for(num_tokens, self._kv.block_size)]
        if self._export is not None:
            self._export(blocks)
        with self._lock:
            handle = self.sender.offer(blocks, num_tokens)
        # The blocks are the lease's from now on: the request's id is free (the stream may come back here).
        lease = f"migration-lease-{handle.transfer_id}"
        self._kv.rekey(request.request_id, lease)
        self._offered[handle.transfer_id] = lease
        self._has_offers.set()
        return handle

    def release(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer (the next worker refused it or failed, or the client left)."""
        with self._lock:
            released = self.sender.withdraw(transfer_id, why)
        if released is not None:
            self._free(released.transfer_id)

    def poll(self) -> None:
        """Answer the pulling workers (NIXL claims) and free the blocks of every lease that ended (loop
        thread)."""
        with self._lock:
            released, self._released = self._released + self.sender.poll(), []
        for blocks in released:
            self._free(blocks.transfer_id)

    def start_polling(self, wake: Callable[[], None]) -> None:
        """Poll the sender on a thread of its own while leases are out; `wake` (the step loop's) is called
        when one ended, so that the loop frees its blocks."""
        self._thread = threading.Thread(target=self._run, args=(wake,), name="migration-offers", daemon=True)
        self._thread.start()

    def _run(self, wake: Callable[[], None]) -> None:
        while not self._is_stopped:
            if not (self._offered or self.sender.expects_claims):
                self._has_offers.clear()
                self._has_offers.wait(IDLE_WAIT_S)
                continue
            with self._lock:
                released = self.sender.poll()
                self._released.extend(released)
            if released:
                wake()
            time.sleep(POLL_S)

    def _free(self, transfer_id: int) -> None:
        lease = self._offered.pop(transfer_id, None)
        if lease is not None:
            self._kv.free(lease)

    def close(self) -> None:
        self._is_stopped = True
        self._has_offers.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5)
        self.sender.close()
