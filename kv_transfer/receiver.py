"""Receiver half (decode side): pulls a KVHandle's source blocks into its own destination blocks.

Lifecycle of one pull (TransferState), keyed by (source_worker_id, transfer_id):
    start_pull()  -> PENDING       checked: peer known, layouts compatible, lease not over by our clock
                                   (compatible: the same bytes, or the same geometry in element types the
                                   pull converts, the source's bytes written into our type on arrival:
                                   kv_transfer/conversion.py)
                  -> TRANSFERRING  bytes moving (torch: after the sender's PullReply; nixl: after its grant)
    poll()        -> DONE          destination blocks hold the source bytes
                  -> FAILED        refused, lease over, deadline passed, or backend error
Every pull has a deadline (config.transfer_timeout_s after start_pull), so nothing hangs; cancel() ends one
early (its request was aborted). A pull whose backend cannot stop it (at the deadline, or cancelled) is
reported only once it has stopped, so no byte lands in destination blocks the owner was told are free.
poll() returns each finished pull once, as a TransferResult.
The sender decides whether a lease is still valid, by its own clock (it refuses late pulls): the check of
handle.lease_deadline against this host's clock is only an early-out, never what keeps a pull safe.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from kv_transfer.capabilities import CAPABILITIES, BackendCapabilities
from kv_transfer.endpoint import TransferEndpoint
from kv_transfer.enums import BackendName, TransferSide, TransferState
from kv_transfer.layout import IncompatibleLayoutError, check_block_ids, check_compatible
from kv_transfer.messages import KVHandle, PeerInfo, PullReply, PullRequest, TransferResult
from kv_transfer.metrics import TransferRecord

PullKey = tuple[str, int]  # (source_worker_id, transfer_id)


@dataclass
class Pull:
    """One pull in flight (internal to the receiver and its backend, never sent)."""

    handle: KVHandle  # what is pulled
    dst_block_ids: tuple[int, ...]  # where it goes
    started_at: float  # time.monotonic() at start_pull
    deadline: float  # time.monotonic() after which the pull is FAILED
    source_block_bytes: int  # bytes a block takes on the wire: the sender's (a converting pull's differ)
    state: TransferState = TransferState.PENDING  # see the module docstring
    reason: str = ""  # why it FAILED
    backend_state: Any = None  # the backend's own handle (NIXL xfer handle, torch work + staging buffer)

    @property
    def key(self) -> PullKey:
        return (self.handle.source_worker_id, self.handle.transfer_id)

    @property
    def is_finished(self) -> bool:
        return self.state in (TransferState.DONE, TransferState.FAILED)

    def fail(self, reason: str) -> None:
        self.state, self.reason = TransferState.FAILED, reason


class KVReceiver(TransferEndpoint, ABC):
    """Base of every backend's receiver. Subclasses implement the backend hooks at the bottom."""

    backend: ClassVar[BackendName]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ranks is not None and not self.capabilities.reads_rank_slices:
            raise ValueError(f"the {self.backend} backend moves a tensor-parallel worker's KV through rank "
                             f"0's staging cache; it cannot take its ranks one by one")
        self.peers: dict[str, PeerInfo] = {}
        self._pulls: dict[PullKey, Pull] = {}

    @property
    def capabilities(self) -> BackendCapabilities:
        """This backend's declared capabilities (kv_transfer/capabilities.py)."""
        return CAPABILITIES[self.backend]

    def add_peer(self, peer: PeerInfo) -> None:
        """Learn a sender (idempotent; a new endpoint under a known worker id replaces the old one); refuses
        an incompatible layout before any byte moves.

        Args:
            peer: the sender's peer_info().

        Raises:
            IncompatibleLayoutError: the peer's blocks neither mean the same bytes as ours nor convert.
            ValueError: the peer was built for another backend.
        """
        self.check_peer(peer)
        known = self.peers.get(peer.worker_id)
        if known == peer:
            return
        if known is not None:  # the worker came back with a new endpoint (a role change): the old is stale
            self.remove_peer(peer.worker_id)
        self._on_add_peer(peer)
        self.peers[peer.worker_id] = peer

    def check_peer(self, peer: PeerInfo) -> None:
        """Whether add_peer() would refuse this sender for what it is (any thread: it reads no state).

        Raises:
            IncompatibleLayoutError: the peer's blocks neither mean the same bytes as ours nor convert.
            ValueError: the peer was built for another backend.
        """
        if peer.backend != self.backend:
            raise ValueError(f"peer {peer.worker_id} uses backend {peer.backend}, receiver {self.backend}")
        check_compatible(peer.layout, self.layout)

    def remove_peer(self, worker_id: str) -> None:
        """Forget a sender that left (a drained worker); later handles from it are refused (KeyError).
        Pulls from it already running end as usual, at the latest at their deadline. The same worker may
        come back (a worker that changed role and back) with a new endpoint: add_peer() learns it anew."""
        if self.peers.pop(worker_id, None) is not None:
            self._on_remove_peer(worker_id)

    def start_pull(self, handle: KVHandle, dst_block_ids: list[int] | tuple[int, ...]) -> TransferState:
        """Start copying the handle's blocks into `dst_block_ids` (same order); poll() to see it finish.

        Args:
            handle: from the sender's offer().
            dst_block_ids: destination blocks, allocated by the owner, one per source block.

        Returns:
            The pull's state right after starting (FAILED at once if the lease is already over).

        Raises:
            IncompatibleLayoutError: the handle's layout fingerprint is not its sender's (add_peer checked
                that the sender's blocks are ours, or convert into ours: kv_transfer/conversion.py).
            KeyError: the source worker was never added with add_peer().
            ValueError: wrong backend, block count mismatch, ids out of range, or a duplicate pull.
        """
        peer = self.peers.get(handle.source_worker_id)
        if peer is None:
            raise KeyError(f"unknown source worker {handle.source_worker_id!r}; call add_peer() first "
                           f"(known: {sorted(self.peers)})")
        if handle.fingerprint != peer.layout.fingerprint:  # offered from another cache than add_peer saw
            raise IncompatibleLayoutError(f"handle fingerprint {handle.fingerprint} != its sender's "
                                          f"{peer.layout.fingerprint} (the sender changed; add it again)")
        if handle.backend != self.backend:
            raise ValueError(f"handle offered through {handle.backend}, this receiver is {self.backend}")
        dst = tuple(int(b) for b in dst_block_ids)
        if len(dst) != len(handle.block_ids):
            raise ValueError(f"{len(handle.block_ids)} source blocks but {len(dst)} destination blocks")
        check_block_ids(peer.layout, handle.block_ids, "source")
        check_block_ids(self.layout, dst, "destination")
        key = (handle.source_worker_id, handle.transfer_id)
        if key in self._pulls:
            raise ValueError(f"transfer {key} is already being pulled")

        now = time.monotonic()
        pull = Pull(handle, dst, now, now + self.config.transfer_timeout_s, peer.layout.block_bytes)
        self._pulls[key] = pull
        # An early-out only: the two hosts' clocks may disagree, so the sender is what refuses a late pull.
        if handle.lease_deadline - self.config.lease_margin_s <= time.time():
            pull.fail(f"lease of transfer {key} is over; not pulling")
        else:
            self._start(pull, peer)
        return pull.state

    def cancel(self, source_worker_id: str, transfer_id: int, why: str) -> bool:
        """Stop a pull nobody wants any more (its request was aborted), without waiting for its deadline.

        Returns:
            True if it is now FAILED (reported by the next poll(): its destination blocks may be freed then);
            False if there is no such unfinished pull, or the backend cannot stop it yet (it ends as usual).
        """
        pull = self._pulls.get((source_worker_id, transfer_id))
        if pull is None or pull.is_finished or not self._abort(pull):
            return False
        pull.fail(why)
        return True

    @property
    def num_pulls(self) -> int:
        """Pulls started and not yet returned by poll()."""
        return len(self._pulls)

    def state(self, source_worker_id: str, transfer_id: int) -> TransferState | None:
        """State of a pull not yet returned by poll(), or None."""
        pull = self._pulls.get((source_worker_id, transfer_id))
        return None if pull is None else pull.state

    def poll(self) -> list[TransferResult]:
        """Advance every pull; return those that finished (DONE or FAILED) since the last poll."""
        self._progress()
        finished: list[Pull] = []
        now = time.monotonic()
        for pull in list(self._pulls.values()):
            if not pull.is_finished:
                self._advance(pull)
            if not pull.is_finished and now > pull.deadline and self._abort(pull):
                pull.fail(f"deadline passed in state {pull.state.name}")
            if pull.is_finished:
                finished.append(pull)
        for pull in finished:
            del self._pulls[pull.key]
            self._record(pull)
        return [TransferResult(p.handle.source_worker_id, p.handle.transfer_id, p.dst_block_ids, p.state,
                               p.reason) for p in finished]

    def take_pull_requests(self) -> list[PullRequest]:
        """Pull requests the caller must deliver to senders (only backends where the sender takes part)."""
        return []

    def on_pull_reply(self, reply: PullReply) -> None:
        """Deliver a sender's answer to a PullRequest (only backends where the sender takes part)."""
        raise NotImplementedError(f"the {self.backend} backend has no pull replies")

    def close(self) -> None:
        """Release backend resources."""
        return None

    def _record(self, pull: Pull) -> None:
        self.recorder.add(TransferRecord(
            role=TransferSide.RECV,
            backend=self.backend,
            source_worker_id=pull.handle.source_worker_id,
            transfer_id=pull.handle.transfer_id,
            num_blocks=len(pull.dst_block_ids),
            num_bytes=len(pull.dst_block_ids) * pull.source_block_bytes,
            duration_s=time.monotonic() - pull.started_at,
            outcome=pull.state.name,
            reason=pull.reason,
        ))

    # Backend hooks.
    def _on_add_peer(self, peer: PeerInfo) -> None:
        """Backend work done once per peer (load NIXL metadata, prepare descriptor lists)."""
        return None

    def _on_remove_peer(self, worker_id: str) -> None:
        """Backend work done when a peer is forgotten."""
        return None

    def _progress(self) -> None:
        """Backend work done once per poll(), before the pulls are advanced (drain notifications, retries)."""
        return None

    @abstractmethod
    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        """Begin the pull: set pull.state to TRANSFERRING (or DONE / FAILED if it finished at once)."""

    @abstractmethod
    def _advance(self, pull: Pull) -> None:
        """Check progress without blocking; set DONE or FAILED when finished."""

    def _abort(self, pull: Pull) -> bool:
        """The deadline passed, or the pull was cancelled: stop it.

        Returns:
            True once nothing of this pull can write its destination blocks any more; False to be asked again
            at the next poll() (the pull stays unreported until then).
        """
        return True
