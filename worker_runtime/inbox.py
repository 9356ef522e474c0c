"""A worker's inbox: how other threads hand work to its step loop, and how a dying loop answers them.

    any thread:  submit(request_id, submission, run, num_tokens) | post(run)   → queued commands
    loop thread: drain() → runs each command in order; take(request_id) once a submission is accepted;
                 settle(request_id) once the worker has answered it for the last time
    loop dies:   fail(error) → the submissions still queued (their callers must be answered); from then on
                 submit() raises WorkerFailed and post() drops its command
One lock guards it all, so a submission either lands before the failure (and fail() returns it) or is
refused; no caller is left waiting on a request the worker will never see.
An id is live from its submit() until its settle(): a second submission under a live id is refused at once
(DuplicateRequest), since two requests under one id would share a block table and the step would raise on
it. The gateway never does this on purpose (each attempt has an id of its own); this keeps a mistake from
killing the worker.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from pool_worker.api import WorkerFailed

Submission = TypeVar("Submission")


class DuplicateRequest(ValueError):
    """A submission under an id the worker still holds (refused to its caller, as any ValueError is)."""


class WorkerInbox(Generic[Submission]):
    def __init__(self, worker_name: str) -> None:
        self.worker_name = worker_name  # for WorkerFailed messages
        self._lock = threading.Lock()
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._arriving: dict[str, Submission] = {}  # submitted, not yet taken by the loop thread
        self._num_tokens = 0  # tokens of the queued submissions (the prefill worker's queue depth)
        self._live: set[str] = set()  # ids submitted and not yet settled (bounded by what the worker holds)
        self.failure = ""  # why the step loop died; set once

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_arriving(self) -> int:
        """Submissions the loop thread has not taken yet."""
        return len(self._arriving)

    def submit(self, request_id: str, submission: Submission, run: Callable[[], None], num_tokens: int = 0,
               output_ids: tuple[str, ...] = ()) -> None:
        """Queue a new request's command; raises WorkerFailed once the loop has died, DuplicateRequest if the
        id (or one of `output_ids`, the ids its outputs stream under) is live here."""
        ids = {request_id, *output_ids}
        with self._lock:
            if self.failure:
                raise WorkerFailed(f"{self.worker_name} failed: {self.failure}")
            if ids & self._live:
                raise DuplicateRequest(f"{self.worker_name} already holds a request under the id "
                                       f"{sorted(ids & self._live)[0]}")
            self._live |= ids
            self._arriving[request_id] = submission
            self._commands.append(run)
            self._num_tokens += num_tokens

    def post(self, run: Callable[[], None]) -> bool:
        """Queue a command for the loop thread (abort, release, a peer to add); False once the loop has died
        (nobody would run it: it is dropped rather than kept until the actor is killed)."""
        with self._lock:
            if self.failure:
                return False
            self._commands.append(run)
            return True

    def drain(self) -> None:
        """Run every queued command, in order (loop thread)."""
        with self._lock:
            commands = list(self._commands)
            self._commands.clear()
            self._num_tokens = 0
        for run in commands:
            run()

    def take(self, request_id: str) -> None:
        """The loop thread has accepted this submission: from now on the worker itself answers it."""
        with self._lock:
            self._arriving.pop(request_id, None)

    def settle(self, *request_ids: str) -> None:
        """The worker has answered these ids for the last time and holds nothing under them (any thread)."""
        with self._lock:
            self._live.difference_update(request_ids)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._live

    def fail(self, error: BaseException) -> list[Submission]:
        """Mark the worker failed; returns the submissions nobody has taken (answer them with an error)."""
        with self._lock:
            self.failure = f"{type(error).__name__}: {error}"
            arriving = list(self._arriving.values())
            self._arriving.clear()
            self._commands.clear()
            self._num_tokens = 0
        return arriving
