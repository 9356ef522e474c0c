"""Sender-side leases on offered source blocks.

Lifecycle of one lease (states of `Lease`):
    offered --claim--> claimed (torch/local: the sender has started or finished sending; nixl: it granted a
                       receiver's claim, and holds the blocks until that receiver's word or the grant's hold)
    offered | claimed --release--> gone, reported PULLED or FAILED by sender.poll()
    offered --deadline passes--> gone, reported EXPIRED by sender.poll()
    offered --withdraw--> gone, reported WITHDRAWN at once
A claimed lease no longer expires: its bytes are already on their way (torch copies them to a staging buffer;
nixl bounds the READ by the grant's hold). Expiry is judged by this host's clock only.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass
class Lease:
    """One offered block set (internal to the sender, never sent)."""

    transfer_id: int  # KVHandle.transfer_id
    block_ids: tuple[int, ...]  # source blocks the owner must not free yet
    num_tokens: int  # tokens held, for the handle
    deadline: float  # wall clock (time.time()) when the lease ends
    offered_at: float  # time.monotonic() at offer, for the record's duration
    is_claimed: bool = False  # a pull has been accepted; expiry no longer applies


class LeaseTable:
    """Outstanding leases of one sender, keyed by transfer id."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease] = {}
        # Random start so a restarted worker with the same id does not reuse its predecessor's transfer ids;
        # below 2**30 so ids stay valid torch p2p tags for a long time.
        self._next_id = random.randrange(1, 2**30)

    def __len__(self) -> int:
        return len(self._leases)

    def offer(self, block_ids: tuple[int, ...], num_tokens: int, lease_s: float) -> Lease:
        """Start a lease on `block_ids` for `lease_s` seconds and return it."""
        lease = Lease(self._next_id, block_ids, num_tokens, time.time() + lease_s, time.monotonic())
        self._next_id = self._next_id + 1 if self._next_id < 2**31 - 1 else 1
        self._leases[lease.transfer_id] = lease
        return lease

    def claim(self, transfer_id: int) -> tuple[Lease | None, str]:
        """Mark a lease as being pulled.

        Returns:
            (lease, "") when claimed, or (None, reason) when the pull must be refused.
        """
        lease = self._leases.get(transfer_id)
        if lease is None:
            return None, f"transfer {transfer_id} is unknown or already released"
        if lease.is_claimed:
            return None, f"transfer {transfer_id} is already being pulled"
        if time.time() > lease.deadline:
            return None, f"lease of transfer {transfer_id} expired before the pull"
        lease.is_claimed = True
        return lease, ""

    def get(self, transfer_id: int) -> Lease | None:
        """The outstanding lease with that id, if any."""
        return self._leases.get(transfer_id)

    def release(self, transfer_id: int) -> Lease | None:
        """Forget a lease; returns it, or None if it was already gone."""
        return self._leases.pop(transfer_id, None)

    def pop_expired(self) -> list[Lease]:
        """Remove and return the unclaimed leases whose deadline has passed."""
        now = time.time()
        expired = [lease for lease in self._leases.values() if not lease.is_claimed and now > lease.deadline]
        for lease in expired:
            del self._leases[lease.transfer_id]
        return expired
