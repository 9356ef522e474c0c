"""In-process backend (colocated prefill and decode): block copies between two tensors.

The receiver finds the sender through a process-local directory keyed by worker id (both live in this
process by definition), claims its lease, and copies synchronously inside start_pull(): PENDING -> DONE, or
FAILED if the sender refuses (lease over, unknown transfer). The sender's next poll() reports PULLED. Blocks
bound for a cache of another element type are converted as they are copied (kv_transfer/conversion.py).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, ClassVar

from kv_transfer.conversion import converted
from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.layout import coalesce_runs
from kv_transfer.receiver import KVReceiver, Pull
from kv_transfer.sender import KVSender

if TYPE_CHECKING:
    import torch

    from kv_transfer.messages import PeerInfo

# Weak, so a dropped sender disappears; only same-process peers can ever be found here.
_SENDERS: weakref.WeakValueDictionary[str, LocalSender] = weakref.WeakValueDictionary()


class LocalSender(KVSender):
    """Sender whose receiver lives in the same process."""

    backend: ClassVar[BackendName] = BackendName.LOCAL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._pulled: list[int] = []
        _SENDERS[self.worker_id] = self

    def copy_out(self, transfer_id: int, dst: torch.Tensor, dst_block_ids: tuple[int, ...]) -> str:
        """Copy an offered transfer's blocks into `dst` (called by LocalReceiver).

        Returns:
            "" on success, else why the pull was refused (nothing is written then).
        """
        lease, reason = self._leases.claim(transfer_id)
        if lease is None:
            return reason
        # One copy_ per run of blocks consecutive on both sides: a single pass over the bytes, where
        # index_select + index_copy_ would make two. copy_ also crosses devices (D2H/H2D) when they differ;
        # into another element type the run is converted as every backend converts (saturating 8-bit).
        for src_start, dst_start, num_blocks in coalesce_runs(lease.block_ids, dst_block_ids):
            blocks = converted(self.kv_cache[src_start:src_start + num_blocks], dst.dtype)
            dst[dst_start:dst_start + num_blocks].copy_(blocks)
        self._pulled.append(transfer_id)
        return ""

    def close(self) -> None:
        _SENDERS.pop(self.worker_id, None)

    def _backend_metadata(self) -> bytes:
        return b""

    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        pulled, self._pulled = self._pulled, []
        return [(transfer_id, ReleaseReason.PULLED, "") for transfer_id in pulled]


class LocalReceiver(KVReceiver):
    """Receiver that copies from a LocalSender of the same process."""

    backend: ClassVar[BackendName] = BackendName.LOCAL

    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        sender = _SENDERS.get(peer.worker_id)
        if sender is None:
            pull.fail(f"local sender {peer.worker_id!r} is not in this process (or was closed)")
            return
        pull.state = TransferState.TRANSFERRING
        reason = sender.copy_out(pull.handle.transfer_id, self.kv_cache, pull.dst_block_ids)
        if reason:
            pull.fail(reason)
        else:
            pull.state = TransferState.DONE

    def _advance(self, pull: Pull) -> None:
        # Local pulls finish inside _start; nothing is ever left in flight.
        return
