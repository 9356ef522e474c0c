"""What a decode worker keeps per request while it is here: the request, where its outputs go, and the
times and bytes its final output reports (DecodeTimes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from decode_pool.messages import DecodeOutput, DecodeRequest
from llm_engine.finish_reason import FinishReason

OutputCallback = Callable[[DecodeOutput], None]


@dataclasses.dataclass
class DecodeEntry:
    request: DecodeRequest
    on_output: OutputCallback  # called on the loop thread with each of the request's outputs
    queued: float  # wall clock when it reached the worker
    transfer_started: float | None = None  # blocks allocated, pull started
    transfer_finished: float | None = None  # pull ended (DONE or FAILED)
    admitted: float | None = None  # joined the running batch
    transfer_bytes: int = 0  # KV bytes pulled (0 when recomputed)
    is_aborted: bool = False  # aborted while its pull runs: it ends when the pull does
    abort_reason: FinishReason = FinishReason.ABORT  # what an aborted request ends with (MIGRATE: evacuated)
