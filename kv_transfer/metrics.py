"""Per-transfer records for metrics: bytes, duration and outcome of every transfer, on both sides."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from kv_transfer.enums import BackendName, TransferSide


@dataclass(frozen=True)
class TransferRecord:
    """One finished transfer, as seen by one side."""

    role: TransferSide  # the side that kept the record
    backend: BackendName  # backend that moved (or was to move) the bytes
    source_worker_id: str  # worker that held the blocks
    transfer_id: int  # KVHandle.transfer_id
    num_blocks: int  # blocks in the transfer
    num_bytes: int  # bytes moved (or that would have moved, on failure)
    duration_s: float  # send: offer to release; recv: start_pull to DONE/FAILED
    outcome: str  # recv: "DONE" / "FAILED"; send: "PULLED" / "EXPIRED" / "FAILED"
    reason: str  # failure reason; empty on success


class TransferRecorder:
    """Keeps the last `capacity` records and hands each one to an optional callback (e.g. Prometheus)."""

    def __init__(self, capacity: int, callback: Callable[[TransferRecord], None] | None = None) -> None:
        """Args:
            capacity: how many recent records `records` keeps; older ones are dropped.
            callback: called synchronously with each new record.
        """
        self._records: collections.deque[TransferRecord] = collections.deque(maxlen=capacity)
        self._callback = callback

    def add(self, record: TransferRecord) -> None:
        """Keep `record` and pass it to the callback."""
        self._records.append(record)
        if self._callback is not None:
            self._callback(record)

    @property
    def records(self) -> list[TransferRecord]:
        """The kept records, oldest first."""
        return list(self._records)
