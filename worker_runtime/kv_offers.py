"""A worker's offered KV: the one owner of the leases through which other workers pull its blocks — a prefill
worker's prompts, a decode or mixed worker's streams handed back (evacuated, or moved off for a long prompt).

Lifecycle of one offer:
    offer(request_id, num_tokens) — loop thread: the blocks holding the request's first num_tokens tokens are
      made whole in the transfer cache (export: a tensor-parallel worker's ranks gathered), leased through
      the KV sender, and handed from the request to the lease (its id is free again at once: another attempt
      of the request may come back to this worker) → the KVHandle goes to the gateway, which gives it to the
      worker that pulls
    → the puller claims and reads (NIXL), or asks the sender to send (torch: accept_pull() from the actor's
      thread) → the sender sees the lease end (pulled, withdrawn, expired or failed): the polling thread
      (start_polling(): it answers claims within POLL_S while a forward runs) collects it and wakes the loop
    → poll() (loop thread, between forwards) frees the lease's blocks (and raises HelperThreadFailed once the
      polling thread has died: the worker fails, worker_runtime/thread_failure.py).
    release(transfer_id) / release_request(request_id): nobody will pull it (the puller refused or failed, the
      client left, the request was aborted): withdrawn now rather than at the lease's end.
Every call on the sender holds one lock; blocks are freed only by the loop thread. While any lease is out the
worker still holds work: a drain or role change waits for it (num_outstanding).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kv_transfer import KVHandle, KVSender, PeerInfo, PullReply, PullRequest, ReleasedBlocks
from llm_engine.kv_cache_manager import KVCacheManager, blocks_for
from worker_runtime.thread_failure import ThreadFailure

POLL_S = 0.002  # the polling thread's period while a lease is out or a claim for withdrawn KV may still come
IDLE_WAIT_S = 0.05  # with nothing out, the thread looks again this often (a safety net: offer() wakes it)


class KVOffers:
    def __init__(self, sender: KVSender, kv: KVCacheManager, owner: str,
                 export: Callable[[Sequence[int]], None] | None = None) -> None:
        """Args:
            owner: names the leases' blocks in the KV manager (unique per worker role).
            export: makes blocks whole in the sender's cache before they are offered
                (LLMEngine.export_blocks); None: they are.
        """
        self.sender = sender
        self._kv = kv
        self._owner = owner
        self._export = export
        self._offered: dict[int, str] = {}  # transfer_id → the request whose blocks the lease holds
        self._lock = threading.Lock()  # every call on the sender
        self._released: list[ReleasedBlocks] = []  # seen by the polling thread, freed by poll()
        self._has_offers = threading.Event()
        self._is_stopped = False
        self._thread: threading.Thread | None = None
        self._failure = ThreadFailure(f"the KV offers' polling thread of {owner}")

    @property
    def num_outstanding(self) -> int:
        """Leases out: their blocks are still held here."""
        return len(self._offered)

    @property
    def is_polled(self) -> bool:
        """A thread polls the sender (else the loop must, between its forwards, while leases are out)."""
        return self._thread is not None

    @property
    def expects_claims(self) -> bool:
        """KV is offered, or was withdrawn recently (its claim must be refused at once). Any thread."""
        return self.sender.expects_claims

    def peer_info(self) -> PeerInfo:
        """What another worker needs once to pull from this one."""
        return self.sender.peer_info()

    def _lease(self, transfer_id: int) -> str:
        return f"{self._owner}-lease-{transfer_id}"

    def offer(self, request_id: str, num_tokens: int) -> KVHandle:
        """Lease the blocks holding the request's first `num_tokens` tokens (loop thread); the request's
        table becomes the lease's."""
        table = self._kv.block_table(request_id)
        blocks = table[:blocks_for(num_tokens, self._kv.block_size)]
        if self._export is not None:
            self._export(blocks)
        with self._lock:
            handle = self.sender.offer(blocks, num_tokens)
        self._kv.rekey(request_id, self._lease(handle.transfer_id))
        self._offered[handle.transfer_id] = request_id
        self._has_offers.set()
        return handle

    def release(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer: withdraw it and free its blocks (loop thread). A lease being
        pulled (claimed), or already ended, is left alone by the sender."""
        with self._lock:
            released = self.sender.withdraw(transfer_id, why)
        if released is not None:
            self._free(released.transfer_id)

    def release_request(self, request_id: str, why: str) -> None:
        """As release(), for every lease of this request (loop thread)."""
        for transfer_id, offered_id in list(self._offered.items()):
            if offered_id == request_id:
                self.release(transfer_id, why)

    def accept_pull(self, pull: PullRequest) -> PullReply:
        """For backends whose sender takes part (torch): post the send leg of a pull (any thread)."""
        with self._lock:
            return self.sender.accept_pull(pull)

    def poll(self) -> int:
        """Answer the pulling workers (NIXL claims) and free the blocks of every lease that ended (loop
        thread); returns how many ended."""
        self._failure.raise_if_any()
        with self._lock:
            released, self._released = self._released + self.sender.poll(), []
        for blocks in released:
            self._free(blocks.transfer_id)
        return len(released)

    def start_polling(self, wake: Callable[[], None]) -> None:
        """Poll the sender on a thread of its own while leases are out; `wake` (the step loop's) is called
        when one ended, so that the loop frees its blocks."""
        self._thread = threading.Thread(target=self._run, args=(wake,), name=f"{self._owner}-offers",
                                        daemon=True)
        self._thread.start()

    def _run(self, wake: Callable[[], None]) -> None:
        try:
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
        except BaseException as error:
            self._failure.record(error)
            wake()  # the loop raises it at its next poll()

    def _free(self, transfer_id: int) -> None:
        if self._offered.pop(transfer_id, None) is not None:
            self._kv.free(self._lease(transfer_id))

    def close(self) -> None:
        self._is_stopped = True
        self._has_offers.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(5)
        self.sender.close()
