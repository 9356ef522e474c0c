"""KV-cache transfer between prefill and decode workers; knows nothing of pools or requests.

Sender half (prefill side)::

    sender = make_sender("nixl", "prefill-0", kv_cache)       # publish sender.peer_info() once
    handle = sender.offer(block_ids, num_tokens)               # KVHandle goes to the decode side
    for released in sender.poll(): pool.free(released.block_ids)

Receiver half (decode side)::

    receiver = make_receiver("nixl", "decode-0", kv_cache)
    receiver.add_peer(peer_info)                               # once per prefill worker
    receiver.start_pull(handle, dst_block_ids); results = receiver.poll()   # DONE / FAILED per pull

Backends whose capabilities say `sender_takes_part` (torch) also need the caller to carry
`receiver.take_pull_requests()` to `sender.accept_pull()` and its reply to `receiver.on_pull_reply()`.
Whatever the backend, the sender's poll() decides, by its own clock, whether a pull may still read a lease's
blocks (nixl answers the receiver's claim there), so keep polling it while leases are outstanding.
"""

from __future__ import annotations

from kv_transfer.capabilities import BackendCapabilities
from kv_transfer.config import TransferConfig
from kv_transfer.enums import BackendName, ReleaseReason, TransferSide, TransferState
from kv_transfer.layout import IncompatibleLayoutError, KVLayout, MemoryRegion, layout_from_tensor
from kv_transfer.messages import KVHandle, PeerInfo, PullReply, PullRequest, ReleasedBlocks, TransferResult
from kv_transfer.metrics import TransferRecord, TransferRecorder
from kv_transfer.receiver import KVReceiver
from kv_transfer.registry import (
    BackendUnavailableError,
    UnknownBackendError,
    can_move_kv_between_decode_workers,
    capabilities,
    make_receiver,
    make_sender,
)
from kv_transfer.sender import KVSender

__all__ = [
    "BackendCapabilities",
    "BackendName",
    "BackendUnavailableError",
    "IncompatibleLayoutError",
    "KVHandle",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "MemoryRegion",
    "PeerInfo",
    "PullReply",
    "PullRequest",
    "ReleaseReason",
    "ReleasedBlocks",
    "TransferConfig",
    "TransferRecord",
    "TransferRecorder",
    "TransferResult",
    "TransferSide",
    "TransferState",
    "UnknownBackendError",
    "can_move_kv_between_decode_workers",
    "capabilities",
    "layout_from_tensor",
    "make_receiver",
    "make_sender",
]
