"""Pure logic of the fleet's lifecycle pieces: the worker state table, and the worker's memory of aborts
that came before their request."""

from __future__ import annotations

import pytest

from gateway.fleet.workers import TRANSITIONS, IllegalTransition, Worker, WorkerState, transition
from worker_runtime.aborted import AbortedIds
from worker_runtime.roles import Role

S = WorkerState


def worker_in(state: WorkerState) -> Worker:
    return Worker("w", Role.DECODE, None, state)  # type: ignore[arg-type]  # no actor: states only


def test_every_state_has_its_allowed_moves_and_stopped_is_final() -> None:
    assert set(TRANSITIONS) == set(WorkerState)
    assert TRANSITIONS[S.STOPPED] == frozenset()
    # Each operation that leaves ACTIVE can come back to it (rolled back), or end FAILED.
    for leaving in (S.DRAINING, S.CHANGING_ROLE):
        assert {S.ACTIVE, S.FAILED} <= TRANSITIONS[leaving]
    # Nothing becomes routable without starting, and a failed worker is never routable again.
    assert S.ACTIVE not in TRANSITIONS[S.PENDING] | TRANSITIONS[S.FAILED]


@pytest.mark.parametrize(("start", "to"), [
    (S.PENDING, S.ACTIVE), (S.FAILED, S.ACTIVE), (S.STOPPED, S.ACTIVE), (S.DRAINING, S.CHANGING_ROLE),
    (S.CHANGING_ROLE, S.DRAINING), (S.ACTIVE, S.STARTING), (S.ACTIVE, S.ACTIVE),
])
def test_a_move_outside_the_table_is_refused_and_changes_nothing(start: WorkerState, to: WorkerState) -> None:
    worker = worker_in(start)
    with pytest.raises(IllegalTransition, match=f"{start.value} → {to.value}"):
        transition(worker, to)
    assert worker.state is start


def test_allowed_moves_are_made() -> None:
    worker = worker_in(S.PENDING)
    for state in (S.STARTING, S.ACTIVE, S.CHANGING_ROLE, S.ACTIVE, S.DRAINING, S.ACTIVE, S.FAILED, S.STOPPED):
        transition(worker, state)
        assert worker.state is state


def test_aborted_ids_are_taken_once_expire_and_stay_bounded() -> None:
    aborted = AbortedIds(ttl_s=10.0, max_remembered=3)
    aborted.remember("a", now=0.0)
    assert aborted.take("a", now=1.0)
    assert not aborted.take("a", now=1.0)  # taken: forgotten
    aborted.remember("old", now=0.0)
    assert not aborted.take("old", now=11.0)  # expired
    for index in range(10):
        aborted.remember(f"r{index}", now=20.0)
    assert len(aborted) == 3  # bounded as ids are added, the oldest dropped
    assert aborted.take("r9", now=20.0) and not aborted.take("r0", now=20.0)
    aborted.remember("late", now=100.0)  # adding also drops what has expired
    assert len(aborted) == 1
