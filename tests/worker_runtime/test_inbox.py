"""WorkerInbox (L9): once the step loop has died, nothing more is queued for it."""

from __future__ import annotations

import pytest

from pool_worker.api import WorkerFailed
from worker_runtime.inbox import WorkerInbox


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
