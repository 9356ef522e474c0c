"""Admission: a request enters only if decode KV capacity can be reserved for prompt + max_tokens.

States of a request here: WAITING (in order of priority, lower first as vLLM's, then of arrival; bounded in
requests and in tokens) → ADMITTED (holds a reservation) → released. A full waiting line, or a wait past the
timeout, is an Overloaded error (HTTP 429 with Retry-After). The capacity is this frontend's share of the live
decode workers' KV, leased by the fleet with every report (set_capacity, gateway/control/remote_fleet.py): a
failed worker's share is gone until its replacement is up, and requests wait for it in the line (within its
timeout). Whoever follows the line (the metrics) is told of every change (on_change).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable

_Waiting = tuple[int, int, int, "asyncio.Future[None]"]  # priority, arrival number, tokens, wakes it


class Overloaded(Exception):
    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    def __init__(self, capacity_tokens: int, max_waiting: int, timeout_s: float,
                 max_waiting_tokens: int | None = None) -> None:
        """Args:
        capacity_tokens: decode KV tokens this frontend may reserve (its share, less the watermarks).
        max_waiting: requests allowed to wait for capacity; beyond that, Overloaded at once.
        timeout_s: how long a request may wait before Overloaded.
        max_waiting_tokens: tokens (prompt + max_tokens) allowed to wait; default: capacity_tokens.
        """
        self.capacity_tokens = capacity_tokens
        self.max_waiting = max_waiting
        self.max_waiting_tokens = capacity_tokens if max_waiting_tokens is None else max_waiting_tokens
        self.timeout_s = timeout_s
        self.reserved_tokens = 0
        self.waiting_tokens = 0
        # (priority, arrival number, tokens, its future), sorted: the head is admitted first.
        self._waiting: list[_Waiting] = []
        self._arrivals = itertools.count()
        # Called after every change of the line or of the reservations (the metrics' gauges follow them).
        self.on_change: list[Callable[[], None]] = []

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def set_capacity(self, capacity_tokens: int) -> None:
        """The decode pool changed size: admit from the line if there is room now."""
        self.capacity_tokens = capacity_tokens
        self._wake()

    def try_acquire(self, num_tokens: int) -> Reservation | None:
        """Reserve `num_tokens` if that needs no wait (nobody in line, room now); None otherwise."""
        if not self._waiting and self.reserved_tokens + num_tokens <= self.capacity_tokens:
            self.reserved_tokens += num_tokens
            self._changed()
            return Reservation(self, num_tokens)
        return None

    async def acquire(self, num_tokens: int, priority: int = 0) -> Reservation:
        """Reserve `num_tokens` of decode capacity, waiting in line if needed (ahead of every waiting request
        of a higher `priority` value, behind those of a lower or the same one).

        Raises:
            Overloaded: the line is full, or the wait passed the timeout.
        """
        reservation = self.try_acquire(num_tokens)
        if reservation is not None:
            return reservation
        if len(self._waiting) >= self.max_waiting:
            raise Overloaded(f"server busy: {len(self._waiting)} requests already wait for KV capacity", 1)
        if self._waiting and self.waiting_tokens + num_tokens > self.max_waiting_tokens:
            raise Overloaded(f"server busy: {self.waiting_tokens} tokens already wait for KV capacity", 1)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), num_tokens, future)
        bisect.insort(self._waiting, entry, key=lambda e: e[:2])
        self.waiting_tokens += num_tokens
        self._wake()  # ahead of the line's head, it may fit where the head does not
        try:
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            self._give_up(entry)
            raise Overloaded(f"no KV capacity for {num_tokens} tokens within {self.timeout_s:.0f} s",
                             max(1, round(self.timeout_s / 4))) from None
        except asyncio.CancelledError:  # the client went away while waiting
            self._give_up(entry)
            raise
        return Reservation(self, num_tokens)

    def _release(self, num_tokens: int) -> None:
        self.reserved_tokens -= num_tokens
        self._wake()

    def _give_up(self, entry: _Waiting) -> None:
        _, _, num_tokens, future = entry
        if future.done():  # admitted just as the wait ended: hand the reservation back
            self.reserved_tokens -= num_tokens
            self._wake()
        else:
            self._waiting.remove(entry)
            self.waiting_tokens -= num_tokens
            future.cancel()
            self._changed()

    def _wake(self) -> None:
        while self._waiting:
            _, _, num_tokens, future = self._waiting[0]
            if self.reserved_tokens + num_tokens > self.capacity_tokens:
                break
            self._waiting.pop(0)
            self.waiting_tokens -= num_tokens
            self.reserved_tokens += num_tokens
            future.set_result(None)
        self._changed()  # every path that changes the line or the reservations ends here or calls it

    def _changed(self) -> None:
        for callback in self.on_change:
            callback()


class Reservation:
    """Decode capacity held by one request; release() is idempotent (stream end and safety net call it)."""

    def __init__(self, admission: Admission, num_tokens: int) -> None:
        self._admission = admission
        self.num_tokens = num_tokens
        self.admitted = time.time()  # when the request left the line (its deadlines start here)
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._admission._release(self.num_tokens)

    async def release_at_stream_end(self) -> None:
        """release(), as a coroutine: Starlette runs a synchronous background task in a worker thread."""
        self.release()
