"""What a worker's helper thread (the pull watcher, the KV offers' poller) does with an exception: it keeps it
for the step loop, which raises it at its next step and so fails the worker the one way a worker fails
(answers every request here with an error, `load().failure` set: the gateway replaces the worker and moves
its streams). A helper thread that ended in silence left the worker routable with pulls nobody polled, each
waiting out its deadline (review P7)."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class HelperThreadFailed(RuntimeError):
    """A worker's helper thread died; the cause is chained."""


class ThreadFailure:
    def __init__(self, thread_name: str) -> None:
        self.thread_name = thread_name
        self._error: BaseException | None = None

    @property
    def happened(self) -> bool:
        return self._error is not None

    def record(self, error: BaseException) -> None:
        """On the helper thread, which then ends."""
        logger.error("%s failed: the worker fails at its next step", self.thread_name, exc_info=error)
        self._error = error

    def raise_if_any(self) -> None:
        """On the step loop's thread."""
        if self._error is not None:
            raise HelperThreadFailed(f"{self.thread_name} failed: {type(self._error).__name__}: {self._error}"
                                     ) from self._error
