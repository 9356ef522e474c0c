"""Sender half (prefill side): offers source blocks under a lease and reports when they may be freed.

Lifecycle of an offered transfer on this side:
    offer() -> KVHandle           lease starts; the owner must keep the blocks
    [torch: accept_pull()]        the sender posts its send leg (claim)
    [nixl: poll()]                the sender grants the receiver's claim notification (claim), or refuses it
    withdraw()                    nobody will pull: an unclaimed lease ends at once (WITHDRAWN); a claim
                                  may still be on its way, so the owner keeps polling (expects_claims)
                                  until the lease would have ended, and the claim is refused at once
    poll() -> ReleasedBlocks      PULLED (receiver has its copy) | EXPIRED (lease ended) | FAILED (send leg)
A sender given a wire dtype (TransferConfig.wire_dtype) offers its blocks in that type: offer() converts them
into a copy of its cache in that type first, and that copy is what the backend moves.
A lease's validity is decided only here, by this host's clock: a pull that comes after the lease ended (or
after a withdraw) is refused. Nothing blocks: poll() is cheap and meant to be called every engine step.
"""

from __future__ import annotations

import os
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from kv_transfer.capabilities import CAPABILITIES, BackendCapabilities
from kv_transfer.endpoint import TransferEndpoint
from kv_transfer.enums import BackendName, ReleaseReason, TransferSide
from kv_transfer.layout import CONVERTIBLE_DTYPES, check_block_ids, layout_from_tensor
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.messages import KVHandle, PeerInfo, PullReply, PullRequest, ReleasedBlocks
from kv_transfer.metrics import TransferRecord


class KVSender(TransferEndpoint, ABC):
    """Base of every backend's sender. Subclasses implement the backend hooks at the bottom."""

    backend: ClassVar[BackendName]
    _wire_copy: Callable[[tuple[int, ...]], None] | None = None  # converts offered blocks (config.wire_dtype)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.ranks is not None and not self.capabilities.reads_rank_slices:
            raise ValueError(f"the {self.backend} backend moves a tensor-parallel worker's KV through rank "
                             f"0's staging cache; it cannot take its ranks one by one")
        if self.config.wire_dtype and self.config.wire_dtype != self.layout.dtype:
            self._use_wire_copy(self.config.wire_dtype)
        self._leases = LeaseTable()
        # Until then a claim for a withdrawn lease may still arrive (its receiver had the handle): it must be
        # refused at once, or that receiver waits for its pull's deadline with its blocks allocated.
        self._claims_possible_until = 0.0

    @property
    def capabilities(self) -> BackendCapabilities:
        """This backend's declared capabilities (kv_transfer/capabilities.py)."""
        return CAPABILITIES[self.backend]

    @property
    def num_outstanding(self) -> int:
        """Transfers offered and not yet released."""
        return len(self._leases)

    @property
    def expects_claims(self) -> bool:
        """Whether poll() may have a receiver to answer: leases are out, or one was withdrawn before its
        deadline (the owner that polls only while leases are out must also poll while this holds)."""
        return bool(self._leases) or time.time() < self._claims_possible_until

    def peer_info(self) -> PeerInfo:
        """The handshake message a receiver needs once before pulling from this sender."""
        return PeerInfo(
            worker_id=self.worker_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            backend=self.backend,
            layout=self.layout,
            backend_metadata=self._backend_metadata(),
        )

    def offer(self, block_ids: list[int] | tuple[int, ...], num_tokens: int, lease_s: float | None = None
              ) -> KVHandle:
        """Offer blocks for one pull; the owner keeps them until poll() releases this transfer.

        Args:
            block_ids: source blocks, in token order.
            num_tokens: tokens whose KV the blocks hold.
            lease_s: seconds the blocks wait for their pull; config.lease_s by default.

        Returns:
            The handle to hand to the receiver.
        """
        ids = tuple(int(b) for b in block_ids)
        check_block_ids(self.layout, ids, "source")
        if self._wire_copy is not None:
            self._wire_copy(ids)
        lease = self._leases.offer(ids, num_tokens, self.config.lease_s if lease_s is None else lease_s)
        return KVHandle(
            source_worker_id=self.worker_id,
            transfer_id=lease.transfer_id,
            block_ids=ids,
            num_tokens=num_tokens,
            fingerprint=self.layout.fingerprint,
            backend=self.backend,
            lease_deadline=lease.deadline,
        )

    def poll(self) -> list[ReleasedBlocks]:
        """Advance the backend and return the transfers whose source blocks the owner may now free.

        Returns:
            One ReleasedBlocks per transfer pulled, expired or failed since the last poll.
        """
        released: list[ReleasedBlocks] = []
        # Completions first, so a pull that finished just before its deadline is reported PULLED.
        for transfer_id, reason, why in self._progress():
            lease = self._leases.release(transfer_id)
            if lease is not None:
                released.append(self._release(lease, reason, why))
        for lease in self._leases.pop_expired():
            released.append(self._release(lease, ReleaseReason.EXPIRED, "lease expired before any pull"))
        return released

    def withdraw(self, transfer_id: int, why: str) -> ReleasedBlocks | None:
        """End a lease early because nobody will pull it (the request was aborted, or its pull failed).

        A claimed lease (the send leg is posted) is left to finish: its bytes are already on their way and
        poll() reports it as usual. Calling this for an unknown or released transfer does nothing.

        Args:
            transfer_id: KVHandle.transfer_id to end.
            why: recorded in the transfer's record.

        Returns:
            The blocks the owner may free now, or None when there is nothing to free yet.
        """
        lease = self._leases.get(transfer_id)
        if lease is None or lease.is_claimed:
            return None
        self._leases.release(transfer_id)
        self._claims_possible_until = max(self._claims_possible_until, lease.deadline)
        return self._release(lease, ReleaseReason.WITHDRAWN, why)

    def accept_pull(self, request: PullRequest) -> PullReply:
        """Start the send leg of a pull (only for backends where the sender takes part).

        Args:
            request: produced by the receiver's take_pull_requests(), delivered by the caller.

        Returns:
            Whether the send leg was posted; deliver it to the receiver's on_pull_reply().
        """
        raise NotImplementedError(f"the {self.backend} backend's sender takes no part in pulls")

    def close(self) -> None:
        """Release backend resources; outstanding leases are dropped without report."""
        return None

    def _release(self, lease: Lease, reason: ReleaseReason, why: str) -> ReleasedBlocks:
        self.recorder.add(TransferRecord(
            role=TransferSide.SEND,
            backend=self.backend,
            source_worker_id=self.worker_id,
            transfer_id=lease.transfer_id,
            num_blocks=len(lease.block_ids),
            num_bytes=len(lease.block_ids) * self.layout.block_bytes,
            duration_s=time.monotonic() - lease.offered_at,
            outcome=reason.name,
            reason="" if reason == ReleaseReason.PULLED else why,
        ))
        return ReleasedBlocks(lease.transfer_id, lease.block_ids, reason)

    def _use_wire_copy(self, dtype_name: str) -> None:
        """Offer blocks in another element type than the cache's: the transfer endpoint becomes a copy of
        the cache in that type (what the backend registers and peers see in peer_info), and offer() converts
        the offered blocks into it first. Same block ids: a block has its own slot whatever is offered (a
        block in two leases at once is written twice with the same values), so the copy never runs out."""
        import torch  # a worker's dependency; a frontend imports kv_transfer without it

        from kv_transfer.conversion import write_blocks

        if self.ranks is not None:
            raise ValueError("a tensor-parallel sender whose ranks are read one by one offers its cache's "
                             "own element type (no wire copy per rank)")
        if self.layout.dtype not in CONVERTIBLE_DTYPES:
            raise ValueError(f"a cache of {self.layout.dtype} converts to no wire type")
        cache = self.kv_cache
        self.kv_cache = torch.empty(cache.shape, dtype=getattr(torch, dtype_name), device=cache.device)
        self.layout = layout_from_tensor(self.kv_cache)

        def convert(block_ids: tuple[int, ...]) -> None:
            write_blocks(self.kv_cache, block_ids, cache[list(block_ids)])

        self._wire_copy = convert

    # Backend hooks.
    @abstractmethod
    def _backend_metadata(self) -> bytes:
        """Opaque bytes a receiver of this backend needs (agent metadata, rank)."""

    @abstractmethod
    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        """Advance the backend; return (transfer_id, PULLED | FAILED, reason) for sends that finished."""
