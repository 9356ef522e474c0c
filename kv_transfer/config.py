"""Transfer-layer settings; each default lives here and only here."""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.layout import CONVERTIBLE_DTYPES


@dataclass(frozen=True)
class TransferConfig:
    """Settings shared by every backend's sender and receiver."""

    lease_s: float = 30.0  # how long an offered block set waits for its pull before the sender frees it
    # A pull not DONE this long after start_pull is FAILED; also the longest a NIXL sender holds granted
    # blocks for one READ, and a torch sender waits for its send leg.
    transfer_timeout_s: float = 10.0
    # The receiver does not start a pull this close to the lease's end by its own clock: a cheap early-out.
    # Safety never rests on it (the hosts' clocks may disagree): the sender refuses a pull after its lease.
    lease_margin_s: float = 0.05
    record_capacity: int = 1024  # TransferRecords kept in memory per sender/receiver
    # NIXL progress thread: sleep this long when idle. 0 (the Python wrapper's hard-coded value) spins a core.
    nixl_progress_delay_us: int = 1000
    # UCX error handling: "peer" turns a dead peer into an error instead of a hang, at some cost under load.
    nixl_error_mode: str = "peer"
    # UCX copies CMA (same-host) transfers in segments of this size, one segment per progress round; its
    # default (hundreds of KiB) made 16-256 MiB READs ~2x slower here. Set through the environment before the
    # agent starts, unless UCX_CMA_SEG_SIZE is already set. Empty: leave UCX's default.
    ucx_cma_seg_size: str = "64M"
    # Each receiving rank of a tensor-parallel worker (NIXL): a buffer for the whole source blocks of pulls
    # whose ranks hold other heads, copied into the cache locally once read (kv_transfer/head_slices.py);
    # a pull larger than its free room goes through a slot of a quarter of it, range by range; one that
    # finds no slot free reads row by row. Allocated at the first such pull.
    rank_scratch_bytes: int = 64 << 20
    # A NIXL sender forgets a receiver (its metadata, its UCX endpoint) that has claimed nothing this long and
    # holds no grant: a receiver's agent changes with every role change and replacement, and a long-lived
    # sender kept them all (review P10). A receiver's claims always carry its connection info, so one that
    # comes back is loaded again.
    idle_receiver_s: float = 120.0
    # The element type blocks cross the wire in where it differs from a sender's cache (--kv-transfer-dtype),
    # a torch dtype name ("float8_e4m3fn"); "": the cache's own. Such a sender keeps a copy of its cache in
    # this type (the same block ids) and converts each offered block into it; the receiver converts what
    # arrives into its own (kv_transfer/conversion.py). Receivers ignore it.
    wire_dtype: str = ""

    def __post_init__(self) -> None:
        if self.lease_s <= 0 or self.transfer_timeout_s <= 0 or self.lease_margin_s < 0:
            raise ValueError(f"lease_s and transfer_timeout_s must be > 0, lease_margin_s >= 0: {self}")
        if self.wire_dtype and self.wire_dtype not in CONVERTIBLE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(CONVERTIBLE_DTYPES)} or empty, got "
                             f"{self.wire_dtype!r}")
        if self.nixl_error_mode not in ("peer", "none"):
            raise ValueError(f"nixl_error_mode must be 'peer' or 'none', got {self.nixl_error_mode!r}")
