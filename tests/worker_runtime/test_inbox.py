"""WorkerInbox (L9): once the step loop has died, nothing more is queued for it."""

from __future__ import annotations

import pytest

from pool_worker.api import WorkerFailed
from worker_runtime.inbox import DuplicateRequest, WorkerInbox


def test_a_failed_inbox_refuses_submissions_and_drops_posts() -> None:
    inbox: WorkerInbox[str] = WorkerInbox("decode worker w")
    ran: list[str] = []
    inbox.submit("r1", "first", lambda: ran.append("r1"))
    assert inbox.fail(RuntimeError("the forward failed")) == ["first"]
    with pytest.raises(WorkerFailed, match="the forward failed"):
        inbox.submit("r2", "second", lambda: ran.append("r2"))
    for _ in range(1000):  # aborts and releases keep coming until the actor is killed
        inbox.post(lambda: ran.append("abort"))
    assert len(inbox._commands) == 0
    inbox.drain()
    assert ran == []


def test_an_id_is_live_from_submit_until_settled() -> None:
    """A second submission under a live id (or one of its output ids) is refused at submit; once settled,
    the id may come again (issue 48: a duplicate used to kill the step loop)."""
    inbox: WorkerInbox[str] = WorkerInbox("decode worker w")
    inbox.submit("r1", "first", lambda: None, output_ids=("r1#0", "r1#1"))
    for request_id, output_ids in [("r1", ()), ("other", ("r1#1",))]:
        with pytest.raises(DuplicateRequest):
            inbox.submit(request_id, "again", lambda: None, output_ids=output_ids)
    assert isinstance(DuplicateRequest("x"), ValueError)  # the actor answers it as a refusal
    inbox.take("r1")
    assert inbox.is_live("r1")  # taken by the loop, still held
    inbox.settle("r1", "r1#0", "r1#1")
    inbox.submit("r1", "again", lambda: None)
