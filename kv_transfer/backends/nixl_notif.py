"""The NIXL notifications a pull exchanges (msgpack via `kv_transfer.wire`); see kv_transfer.backends.nixl.

    receiver -> sender  CLAIM   may I READ transfer_id? I will trust a READ for hold_s seconds from now
    sender -> receiver  GRANT   lease claimed (it no longer expires); I keep the blocks hold_s from now
    sender -> receiver  REFUSE  no READ: lease expired by my clock, withdrawn, unknown or already pulled
    receiver -> sender  PULLED  attached to the READ itself: sent when it completes
    receiver -> sender  DROP    granted, but no READ of mine will touch the blocks any more: free them now
Only durations cross between the hosts, never clock readings, so the two clocks need not agree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum

from kv_transfer import wire

logger = logging.getLogger(__name__)


class NotifKind(IntEnum):
    """What a NixlNotif says (see the module docstring)."""

    CLAIM = 0
    GRANT = 1
    REFUSE = 2
    PULLED = 3
    DROP = 4


@dataclass(frozen=True)
class NixlNotif:
    """One NIXL notification about one transfer, between a NixlReceiver and a NixlSender."""

    kind: NotifKind  # see the module docstring
    transfer_id: int  # KVHandle.transfer_id it is about
    # CLAIM: seconds the receiver's pull has left; GRANT: seconds the sender holds the blocks (<= the
    # claim's). Each side counts on its own clock from its own event, the claim's sending first. 0 otherwise.
    hold_s: float
    reason: str  # REFUSE, DROP: why; empty otherwise
    # CLAIM: the receiver's NIXL connection info, so the sender can answer; sent until that sender has
    # answered one claim, empty afterwards and in every other kind.
    connection_info: bytes


def encode_notif(kind: NotifKind, transfer_id: int, hold_s: float = 0.0, reason: str = "",
          connection_info: bytes = b"") -> bytes:
    """Encode one notification for NixlAgent.send_notif() (or a READ's completion notification)."""
    return wire.encode(NixlNotif(kind, transfer_id, hold_s, reason, connection_info))


def decode_notif(message: bytes, sender: str) -> NixlNotif | None:
    """Decode a notification; None (logged) for one that is not ours or is malformed."""
    try:
        return wire.decode(NixlNotif, message)
    except Exception as exc:
        logger.warning("ignored a NIXL notification from %s that is not a kvx one: %s", sender, exc)
        return None
