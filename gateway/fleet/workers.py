"""A worker as the gateway sees it (its role, its client, its state) and what /health reports of the pools.

States (WorkerState), every allowed move in TRANSITIONS, made only through transition():
    PENDING (Ray has not placed it: no node offers its resources yet) → STARTING (placed, loading the model)
    → ACTIVE → DRAINING → STOPPED;  ACTIVE → CHANGING_ROLE → ACTIVE (in its new role);
    DRAINING | CHANGING_ROLE → ACTIVE again when the operation is cancelled or fails part way (rolled back);
    any live state → FAILED → STOPPED (replaced);  PENDING | STARTING → STOPPED (a bring-up given up).
Only ACTIVE workers are routed to.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from gateway.fleet.worker_client import WorkerClient
from worker_runtime.info import WorkerRuntime
from worker_runtime.roles import Role


class WorkerState(enum.Enum):
    PENDING = "pending"  # created, waiting for a node with the resources its role asks for
    STARTING = "starting"
    ACTIVE = "active"
    DRAINING = "draining"  # leaving the deployment once it holds nothing
    CHANGING_ROLE = "changing_role"  # drained, then serves in another role (same process, same weights)
    FAILED = "failed"  # not routable; killed and replaced
    STOPPED = "stopped"  # out of the deployment (drained, replaced, or its bring-up given up)


_S = WorkerState
TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    _S.PENDING: frozenset({_S.STARTING, _S.FAILED, _S.STOPPED}),
    _S.STARTING: frozenset({_S.ACTIVE, _S.FAILED, _S.STOPPED}),
    _S.ACTIVE: frozenset({_S.DRAINING, _S.CHANGING_ROLE, _S.FAILED, _S.STOPPED}),
    _S.DRAINING: frozenset({_S.STOPPED, _S.FAILED, _S.ACTIVE}),
    _S.CHANGING_ROLE: frozenset({_S.ACTIVE, _S.FAILED, _S.STOPPED}),
    _S.FAILED: frozenset({_S.STOPPED}),
    _S.STOPPED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow."""


def can_transition(worker: Worker, new_state: WorkerState) -> bool:
    return new_state in TRANSITIONS[worker.state]


def transition(worker: Worker, new_state: WorkerState) -> None:
    """Move `worker` to `new_state`, or raise IllegalTransition (the state is left as it was)."""
    if not can_transition(worker, new_state):
        raise IllegalTransition(f"{worker.worker_id}: {worker.state.value} → {new_state.value} is not "
                                "allowed")
    worker.state = new_state


@dataclass
class Worker:
    worker_id: str
    role: Role
    client: WorkerClient  # every call to its actor goes through it
    state: WorkerState = WorkerState.STARTING
    next_role: Role | None = None  # while CHANGING_ROLE
    node_id: str | None = None  # Ray node the worker was placed on (None while PENDING)
    node_ip: str | None = None  # that node's address
    pid: int | None = None  # the actor's process on that node (None while PENDING)
    cpu_slot: int | None = None  # its slot among the live workers of its node: which cores it pins to
    tp: int = 1  # its ranks (tensor-parallel degree), fixed for its life; its role's degree may change since
    runtime: WorkerRuntime | None = None  # dtype, GEMM kernel, threads and cores, as start() reported them
    placement_deadline: float | None = None  # Unix time an added PENDING worker is given up (add_worker)
    # While DRAINING or CHANGING_ROLE: what it still waits for before it is empty ("" once it is, or when
    # it is not emptying): /admin/pools shows it, so a slow change explains itself.
    emptying: str = ""
    created_at: float = field(default_factory=time.monotonic)  # its bring-up's lines count from here

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
    reason: str = ""  # why unavailable, where it is not the workers (the fleet actor is unreachable)

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
