"""Typed messages that cross the prefill/decode boundary (msgpack via `kv_transfer.wire`).

Handshake:  sender.peer_info() -> PeerInfo -> receiver.add_peer()            (once per peer pair)
Handoff:    sender.offer() -> KVHandle -> receiver.start_pull()               (once per request)
torch only: receiver.take_pull_requests() -> PullRequest -> sender.accept_pull() -> PullReply
            -> receiver.on_pull_reply()            (the sender must take part; deliver every reply, any order)
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class PeerInfo:
    """What a receiver learns once about a sender before pulling from it."""

    worker_id: str  # unique id of the sending worker (its NIXL agent name adds the endpoint's incarnation)
    hostname: str  # host of the sender's process, to detect colocation
    pid: int  # process id of the sender, to detect the same-process (local) case
    backend: BackendName  # backend the sender was built for
    layout: KVLayout  # the sender's KV memory
    backend_metadata: bytes  # opaque per backend: NIXL agent metadata, torch rank; empty for local


@dataclass(frozen=True)
class KVHandle:
    """What the prefill side returns for one request and the decode side consumes to pull its KV."""

    source_worker_id: str  # worker that holds the blocks (PeerInfo.worker_id)
    transfer_id: int  # unique per source worker; also the torch p2p tag and the NIXL notification payload
    block_ids: tuple[int, ...]  # source block ids, in token order
    num_tokens: int  # tokens whose KV the blocks hold
    fingerprint: str  # KVLayout.fingerprint of the source; checked before any byte moves
    backend: BackendName  # backend the sender offers the blocks through
    lease_deadline: float  # wall-clock time (time.time()) after which the source may free the blocks


@dataclass(frozen=True)
class PullRequest:
    """Receiver -> sender, for backends where the sender must take part (torch)."""

    source_worker_id: str  # the sender addressed
    transfer_id: int  # KVHandle.transfer_id being pulled
    destination_worker_id: str  # the pulling worker, for logs and records
    destination_rank: int  # torch.distributed rank the sender must isend to


@dataclass(frozen=True)
class PullReply:
    """Sender -> receiver: did the sender start sending (torch)?"""

    source_worker_id: str  # the sender that answers
    transfer_id: int  # KVHandle.transfer_id answered
    is_accepted: bool  # True: the send leg is posted; False: refused (lease expired, unknown id)
    reason: str  # why it was refused; empty when accepted
    # Accepted: how many sends this sender posted to the same destination rank before this one (0, 1, ...).
    # The receiver posts its receives in this order, whatever order the replies arrive in. -1 when refused.
    send_seq: int
    num_blocks: int  # blocks in the send leg, so a receiver that gave up can still match it; 0 when refused


@dataclass(frozen=True)
class ReleasedBlocks:
    """Reported by sender.poll(): the owner may now free (or reuse) these source blocks."""

    transfer_id: int  # KVHandle.transfer_id
    block_ids: tuple[int, ...]  # the source blocks handed back
    reason: ReleaseReason  # pulled, lease expired, or send failed


@dataclass(frozen=True)
class TransferResult:
    """Reported by receiver.poll() once a pull has finished, either way."""

    source_worker_id: str  # KVHandle.source_worker_id
    transfer_id: int  # KVHandle.transfer_id
    dst_block_ids: tuple[int, ...]  # destination blocks the pull wrote into
    state: TransferState  # DONE or FAILED
    reason: str  # why it failed; empty when DONE
