"""A decode worker's two pull queues (SGLang's Prealloc and Transfer queues), on the step loop's thread:

    AWAITING_BLOCKS  requests with a KV handle, oldest first, until blocks for the prompt plus the
                     watermark reserve are free: admit() allocates them and starts the pull
    TRANSFERRING     blocks allocated, pull started; polled by the PullWatcher's thread as it runs and at
                     every step, never awaited: take_ended() hands over each ended pull (DONE or FAILED)
                     with the time it was seen ended

A pull the receiver refuses at its start ends FAILED at once (admit()'s on_refused: the worker recomputes
the prompt). The receiver is shared with the watcher's thread: every call on it holds the watcher's lock
(with_receiver()).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode_pool.entry import DecodeEntry
from decode_pool.pull_watcher import PullWatcher
from kv_transfer import KVHandle, KVReceiver, PullRequest, TransferState
from llm_engine.engine import LLMEngine
from llm_engine.kv_cache_manager import blocks_for, chain_root

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullEnd:
    """One pull that ended, for the worker to act on."""

    request_id: str
    state: TransferState  # DONE or FAILED
    reason: str  # why it FAILED
    finished_at: float  # wall clock when it was seen ended


class PullQueue:
    def __init__(self, engine: LLMEngine, receiver: KVReceiver, wake: Callable[[], None],
                 deliver_pull: Callable[[PullRequest], None], name: str) -> None:
        """Args:
        wake: wakes the step loop when the watcher thread sees a pull end.
        deliver_pull: carries a PullRequest to its sender (backends whose sender takes part).
        name: the watcher thread's name.
        """
        self.engine = engine
        self.receiver = receiver
        self._watcher = PullWatcher(receiver, wake, deliver_pull, name)
        self.is_watching = False  # the watcher thread runs (else pulls are polled at each step only)
        # The queues own the entries they hold (the worker's table names them too, for their ends).
        self._awaiting_blocks: collections.deque[DecodeEntry] = collections.deque()
        self._transferring: dict[tuple[str, int], DecodeEntry] = {}  # by (source worker, transfer id)

    @property
    def num_awaiting_blocks(self) -> int:
        return len(self._awaiting_blocks)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    def start_watching(self) -> None:
        self._watcher.start()
        self.is_watching = True

    def stop_watching(self) -> None:
        self._watcher.stop()

    def with_receiver(self, call: Callable[[], None]) -> None:
        """Call on the receiver, holding the lock it shares with the watcher thread."""
        with self._watcher.lock:
            call()

    def add(self, entry: DecodeEntry) -> None:
        """The request (with a KV handle) waits for blocks."""
        self._awaiting_blocks.append(entry)

    def withdraw(self, request_id: str) -> bool:
        """Take a request out of AWAITING_BLOCKS; False: it is not there (its pull started, or none)."""
        for entry in self._awaiting_blocks:
            if entry.request.request_id == request_id:
                self._awaiting_blocks.remove(entry)
                return True
        return False

    def is_transferring(self, request_id: str) -> bool:
        return any(e.request.request_id == request_id for e in self._transferring.values())

    def cancel(self, handle: KVHandle, why: str) -> None:
        """Stop a running pull where the backend can; its end still comes through take_ended()."""
        with self._watcher.lock:
            self.receiver.cancel(handle.source_worker_id, handle.transfer_id, why)

    def admit(self, on_refused: Callable[[str, str], None]) -> int:
        """Start pulls, oldest first, while blocks for the prompt plus the watermark reserve are free;
        returns how many started. A pull the receiver refuses goes to on_refused(request_id, why) at once,
        its blocks still allocated."""
        pool = self.engine.block_pool
        num_started = 0
        while self._awaiting_blocks:
            entry = self._awaiting_blocks[0]
            handle = entry.request.kv_handle
            assert handle is not None
            busy = self.engine.scheduler.num_unfinished or self._transferring
            reserve = self.engine.scheduler.watermark_blocks if busy else 0
            # Several choices: room for each one's copy of the partial last block too (fork_blocks).
            num_copies = self.engine.kv.num_fork_blocks(handle.num_tokens, len(entry.request.choices) or 1)
            num_blocks = blocks_for(handle.num_tokens, self.engine.config.block_size) + num_copies
            if not pool.can_allocate(num_blocks + reserve):
                return num_started
            self._awaiting_blocks.popleft()
            request_id = entry.request.request_id
            dst = self.engine.kv.allocate_blocks(request_id, handle.num_tokens,
                                                 chain_root(entry.request.sampling.cache_salt))
            entry.transfer_started = time.time()
            # What crosses the wire: the sender's blocks (of another size where the pull converts them).
            source = self.receiver.peers.get(handle.source_worker_id)
            block_bytes = source.layout.block_bytes if source else self.engine.kv_block_bytes
            entry.transfer_bytes = len(dst) * block_bytes
            try:
                with self._watcher.lock:
                    self.receiver.start_pull(handle, dst)
                    self._watcher.watch()
            except (KeyError, ValueError) as error:
                logger.warning("pull for %s refused (%s); recomputing the prompt here", request_id, error)
                on_refused(request_id, str(error))
                continue
            self._transferring[(handle.source_worker_id, handle.transfer_id)] = entry
            num_started += 1
        return num_started

    def wait_finished(self, timeout: float) -> None:
        """Wait (watcher running) until no pull is in flight, at most `timeout` seconds."""
        self._watcher.wait_finished(timeout)

    def take_ended(self) -> list[PullEnd]:
        """Every pull that ended since the last call, leaving TRANSFERRING."""
        ended = []
        for result, finished_at in self._watcher.take():
            entry = self._transferring.pop((result.source_worker_id, result.transfer_id), None)
            if entry is not None:
                ended.append(PullEnd(entry.request.request_id, result.state, result.reason, finished_at))
        return ended
