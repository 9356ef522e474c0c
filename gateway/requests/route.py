"""Where one request runs: the workers the router picks for it, its bookings in the router's books, and
where it is now.

    pick_decode() → its tokens booked on that decode worker at once (a burst spreads; a drain or role change
      waits for the booking), moved with the request as it moves, released at its end (release())
    prefill_booking(worker) / local_prefill(worker): context managers that book the prompt's tokens on the
      worker that prefills it and release them however the block ends
    wait_for_worker(*roles): the router's pick among live workers, waiting for a replacement until a deadline
    at(stage): where the request is now ("waiting for a prefill worker", "decoding on worker-2")
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.fleet.workers import Worker
from gateway.requests.events import FailureCode, RequestFailed
from gateway.requests.fleet_view import FleetView
from gateway.requests.router import Router
from gateway.requests.state import RequestState
from worker_runtime.roles import Role

WORKER_POLL_S = 0.1  # while waiting for a replacement worker


class RequestRoute:
    def __init__(self, router: Router, state: RequestState, num_reserved: int) -> None:
        """Args:
            num_reserved: the tokens booked on the request's decode worker (prompt + what it may generate).
        """
        self.router = router
        self.state = state
        self.num_reserved = num_reserved
        self._booked: str | None = None  # the decode worker holding that booking

    @property
    def fleet(self) -> FleetView:
        return self.router.fleet

    def at(self, stage: str) -> None:
        """Where the request is now: a drain that waits for its booking says so."""
        self.router.stages[self.state.request_id] = stage

    def book(self, decode: Worker | None) -> None:
        """Move the request's decode booking to `decode` (None: release it, and forget its stage)."""
        worker_id = decode.worker_id if decode is not None else None
        request_id = self.state.request_id
        if worker_id is None:
            self.router.stages.pop(request_id, None)
        if worker_id == self._booked:
            return
        if self._booked is not None:
            self.router.unbook_decode(self._booked, self.num_reserved, request_id)
        if worker_id is not None:
            self.router.book_decode(worker_id, self.num_reserved, request_id)
        self._booked = worker_id

    def release(self) -> None:
        self.book(None)

    @contextmanager
    def prefill_booking(self, prefill: Worker) -> Iterator[None]:
        """The prompt's tokens count on its prefill worker while the block runs."""
        num_tokens, request_id = len(self.state.prompt_token_ids), self.state.request_id
        self.router.book_prefill(prefill.worker_id, num_tokens, request_id)
        try:
            yield
        finally:
            self.router.unbook_prefill(prefill.worker_id, num_tokens, request_id)

    @contextmanager
    def local_prefill(self, decode: Worker, attempt_id: str) -> Iterator[None]:
        """The prompt's tokens count as a decode worker's own prefill (the ratio controller's view) from now
        until end_local_prefill() (its first token came) or the block's end, whichever is first."""
        self.router.start_local_prefill(decode.worker_id, attempt_id, len(self.state.prompt_token_ids))
        try:
            yield
        finally:
            self.router.end_local_prefill(decode.worker_id, attempt_id)

    async def pick_decode(self, deadline: float, exclude: set[str] | None = None) -> Worker:
        decode = await self.wait_for_worker(Role.DECODE, Role.MIXED, deadline=deadline, exclude=exclude,
                                            is_new=not self.state.generated)
        self.book(decode)
        return decode

    async def wait_for_worker(self, *roles: Role, deadline: float, exclude: set[str] | None = None,
                              is_new: bool = False) -> Worker:
        """The router's pick among live workers of `roles` not in `exclude`; waits for a replacement until
        `deadline`. `is_new`: a decode worker for a request with no token yet (its prompt may be prefilled
        there)."""
        state = self.state
        is_decode = Role.PREFILL not in roles
        what = "decode" if is_decode else "prefill"
        while True:
            candidates = [w for w in self.fleet.active(*roles) if w.worker_id not in (exclude or ())]
            if candidates:
                num_prompt = len(state.prompt_token_ids) if is_new else 0
                return (self.router.pick_decode(candidates, num_prompt) if is_decode
                        else self.router.pick_prefill(state.prompt_token_ids, candidates, state.block_hashes))
            self.at(f"waiting for a {what} worker")
            if not (self.fleet.is_replacing(*roles) or self.is_role_coming(*roles)):
                raise RequestFailed(f"no {what} worker is alive and none is starting", FailureCode.NO_WORKER)
            if state.time_left(deadline) <= 0:
                raise RequestFailed(f"no {what} worker became available before the request's deadline",
                                    FailureCode.NO_WORKER)
            await asyncio.sleep(WORKER_POLL_S)

    def is_role_coming(self, *roles: Role) -> bool:
        """Whether a worker is changing role into one of `roles` (it will be routable shortly)."""
        return any(w.next_role in roles for w in self.fleet.workers.values())

    def has_prefill_pool(self) -> bool:
        """Prefill workers serve, or will (a replacement starting, a worker changing role into one)."""
        return bool(self.fleet.active(Role.PREFILL) or self.fleet.is_replacing(Role.PREFILL)
                    or self.is_role_coming(Role.PREFILL))
