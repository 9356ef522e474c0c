"""The enums shared by messages, backends and the registry."""

from __future__ import annotations

from enum import IntEnum, StrEnum


class BackendName(StrEnum):
    """Transfer backends known to the registry (`registry.BACKENDS`)."""

    LOCAL = "local"  # same process (colocated prefill and decode): index_copy between two tensors
    NIXL = "nixl"  # NIXL agents over UCX: the receiver READs once the sender granted its claim (notification)
    TORCH = "torch"  # torch.distributed isend/irecv (gloo on CPU, NCCL on GPU): both sides take part


class TransferSide(StrEnum):
    """Which side of a transfer a TransferRecord was kept on."""

    SEND = "send"  # the sender (prefill side, or a decode worker offering a moved stream), at release
    RECV = "recv"  # the receiver (decode side), at DONE or FAILED


class TransferState(IntEnum):
    """Lifecycle of one pull on the receiver side: PENDING -> TRANSFERRING -> DONE | FAILED."""

    PENDING = 0  # accepted locally, waiting for the sender (torch: the reply to the pull request)
    TRANSFERRING = 1  # bytes are moving
    DONE = 2  # every destination block holds the source's bytes
    FAILED = 3  # refused, expired, timed out or errored; the destination blocks hold nothing usable


class ReleaseReason(IntEnum):
    """Why the sender hands a transfer's source blocks back to their owner."""

    PULLED = 0  # the receiver has its copy
    EXPIRED = 1  # nobody pulled before the lease ended
    FAILED = 2  # the send leg errored or timed out; nothing reads the blocks any more
    WITHDRAWN = 3  # the owner or the receiver said nobody will pull (abort, failed pull): freed at once
