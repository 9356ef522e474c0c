"""A worker as the gateway sees it (its kind, its actor, its state) and what /health reports of the pools.

States (WorkerState): STARTING → ACTIVE → DRAINING → removed; ACTIVE | DRAINING → FAILED → replaced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

# What the HTTP API calls each kind: a colocated worker is a "mixed" one (it prefills and decodes).
KIND_NAMES = {"prefill": "prefill", "decode": "decode", "colocated": "mixed"}


class WorkerState(enum.Enum):
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"
    FAILED = "failed"


@dataclass
class Worker:
    worker_id: str
    role: str  # "prefill" or "decode"
    actor: Any  # Ray actor handle
    state: WorkerState = WorkerState.STARTING
    is_colocated: bool = False  # prefills its own requests (role is then "decode")

    @property
    def is_active(self) -> bool:
        return self.state is WorkerState.ACTIVE

    @property
    def kind(self) -> str:
        """What the worker was started as: "prefill", "decode" or "colocated"."""
        return "colocated" if self.is_colocated else self.role


@dataclass(frozen=True)
class PoolHealth:
    """What /health reports: states and counts only, never internals."""

    # "ok": every target worker active; "degraded": some missing or being replaced; "unavailable": cannot
    # serve and nothing is starting.
    status: str
    active: dict[str, int]  # kind → active workers
    target: dict[str, int]  # kind → workers the deployment should have
    num_replacing: int  # failed workers whose replacement is starting

    @staticmethod
    def of(workers: list[Worker], target: dict[str, int], num_replacing: int) -> PoolHealth:
        active = dict.fromkeys(target, 0)
        for worker in workers:
            if worker.is_active:
                active[worker.kind] += 1
        can_prefill = active["prefill"] + active["colocated"]
        can_decode = active["decode"] + active["colocated"]
        if not can_prefill or not can_decode:
            # Requests wait for a replacement that is starting (within their deadlines): degraded, not down.
            status = "degraded" if num_replacing else "unavailable"
        elif any(active[kind] < target[kind] for kind in target):
            status = "degraded"
        else:
            status = "ok"
        return PoolHealth(status, active, dict(target), num_replacing)
