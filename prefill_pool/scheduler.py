"""The prefill worker's scheduler: the engine's chunked-prefill scheduler whose requests stop at one token.

Queues: WAITING → RUNNING (prompt chunks under the per-step token budget) → PREFILLED.
A prefilled request leaves the scheduler but keeps its blocks: they belong to the KV handoff until the
decode side has pulled them (or the lease ends); the worker frees them then.
"""

from __future__ import annotations

from llm_engine.request import Request
from llm_engine.scheduler import Scheduler


class PrefillScheduler(Scheduler):
    def release(self, request: Request) -> None:
        # Not freed here: the worker offers these blocks to the decode side and frees them once released.
        return None
