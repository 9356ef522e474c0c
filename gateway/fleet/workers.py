"""A worker as the gateway sees it (its role, its actor, its state) and what /health reports of the pools.

States (WorkerState): PENDING (Ray has not placed it: no node offers its resources yet) → STARTING (placed on
a node, loading the model) → ACTIVE → DRAINING → removed;  ACTIVE → CHANGING_ROLE → ACTIVE (in its new
role);  ACTIVE | DRAINING | CHANGING_ROLE → FAILED → replaced. Only ACTIVE workers are routed to.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from pool_worker import Role, WorkerRuntime


class WorkerState(enum.Enum):
    PENDING = "pending"  # created, waiting for a node with the resources its role asks for
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"  # leaving the deployment once it holds nothing
    CHANGING_ROLE = "changing_role"  # drained, then serves in another role (same process, same weights)
    FAILED = "failed"


@dataclass
class Worker:
    worker_id: str
    role: Role
    actor: Any  # Ray actor handle (pool_worker.WorkerActor)
    state: WorkerState = WorkerState.STARTING
    next_role: Role | None = None  # while CHANGING_ROLE
    node_id: str | None = None  # Ray node the worker was placed on (None while PENDING)
    node_ip: str | None = None  # that node's address
    pid: int | None = None  # the actor's process on that node (None while PENDING)
    cpu_slot: int | None = None  # its slot among the live workers of its node: which cores it pins to
    runtime: WorkerRuntime | None = None  # dtype, GEMM kernel, threads and cores, as start() reported them

    @property
    def is_active(self) -> bool:
        return self.state is WorkerState.ACTIVE


@dataclass(frozen=True)
class PoolHealth:
    """What /health reports: states and counts only, never internals."""

    # "ok": every target worker active; "degraded": some missing or being replaced; "unavailable": cannot
    # serve and nothing is starting.
    status: str
    active: dict[str, int]  # role → active workers
    target: dict[str, int]  # role → workers the deployment should have
    num_replacing: int  # failed workers whose replacement is starting
    num_pending: int  # workers no node can take yet (not enough nodes with their role's resources)

    @staticmethod
    def of(workers: list[Worker], target: dict[Role, int], num_replacing: int) -> PoolHealth:
        active = {role.value: 0 for role in Role}
        for worker in workers:
            if worker.is_active:
                active[worker.role.value] += 1
        num_pending = sum(w.state is WorkerState.PENDING for w in workers)
        # Any worker that decodes can serve alone: with no prefill worker left, decode workers prefill for
        # themselves. A worker changing role is missing from its old role and not yet in its new one:
        # degraded, as is a missing or replaced one. With no worker to decode, requests wait for a
        # replacement or a role change (within their deadlines): degraded, not down.
        can_decode = active[Role.DECODE] + active[Role.MIXED]
        is_changing = any(w.state is WorkerState.CHANGING_ROLE for w in workers)
        if not can_decode:
            status = "degraded" if num_replacing or num_pending or is_changing else "unavailable"
        elif is_changing or any(active[role.value] < target[role] for role in Role):
            status = "degraded"
        else:
            status = "ok"
        return PoolHealth(status, active, {role.value: n for role, n in target.items()}, num_replacing,
                          num_pending)
