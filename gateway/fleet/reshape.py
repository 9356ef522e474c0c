"""Reshaping the pools in place: a worker's role change and its drain.

    change_role(): decode ⇄ mixed at once (same front, routed differently). To or from prefill the worker is
    CHANGING_ROLE: not routable; it empties (drain.wait_until_empty, its decode streams evacuated), its
    endpoint is unwired, set_role() rebuilds its front over the same weights and KV cache (asked again if
    work landed late: StillBusy), its peers are rewired → ACTIVE in the new role.
    drain_worker(): ACTIVE → DRAINING (not routable; finishes what it holds, or after grace_s evacuates it)
    → shut down and forgotten (STOPPED).
Either puts the worker back on any exception or cancellation (state, next_role, target and wiring as they
were), or, where the worker's own state is unknown (its set_role call failed or was cut off), marks it
FAILED so that it is replaced. Neither may take away the last active worker that can decode.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from typing import TYPE_CHECKING

from gateway.fleet.drain import (
    DRAIN_GRACE_S,
    DRAIN_TIMEOUT_S,
    BooksOnTheWay,
    check_grace,
    wait_until_empty,
)
from gateway.fleet.worker_errors import LastDecoder, StillBusy
from gateway.fleet.workers import Worker, WorkerState, transition
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from gateway.fleet.recovery import Recovery
    from gateway.fleet.table import WorkerTable
    from gateway.fleet.wiring import PeerWiring

logger = logging.getLogger(__name__)

SET_ROLE_ATTEMPTS = 5  # a role change refused because work landed late is asked again this often


class Reshape:
    """Owns role changes and drains, and the rewiring they leave running in the background."""

    def __init__(self, table: WorkerTable, wiring: PeerWiring, recovery: Recovery) -> None:
        """Args:
            table: the fleet's workers and target layout.
            wiring: tells the peers of a worker whose endpoint goes or comes back.
            recovery: replaces a worker left in an unknown state (mark_failed).
        """
        self.table = table
        self.wiring = wiring
        self.recovery = recovery
        self.rewiring: set[asyncio.Task[None]] = set()  # role changes finishing in the background

    async def change_role(self, worker_id: str, role: Role, books: BooksOnTheWay | None = None,
                          grace_s: float = 0.0, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Move an active worker to `role` without restarting it (see the lifecycle above).

        Args:
            books: the routers' count of what they have sent the worker and not seen come back.
            grace_s: how long its decode streams may run on before they are evacuated to other workers.
        """
        table = self.table
        table.check_can_change()
        check_grace(grace_s, timeout_s)
        worker, role = table.workers[worker_id], Role(role)
        old = worker.role
        if not worker.is_active:
            raise RuntimeError(f"{worker_id} is {worker.state.value}, not active")
        if role is old:
            return
        self._check_others_can_decode(worker, role)
        if old.can_decode and role.can_decode:  # decode ⇄ mixed: only the routing changes
            await worker.client.set_role(role)
            worker.role = role
            table.move_target(old, role)
            table.changed()
            return
        transition(worker, WorkerState.CHANGING_ROLE)
        worker.next_role = role
        table.move_target(old, role)
        table.changed()
        is_unwired = is_sent = False
        try:
            await wait_until_empty(worker, books, grace_s, timeout_s)
            self.wiring.unwire(worker)  # its endpoint closes with its old front
            is_unwired = is_sent = True
            for attempt in range(1, SET_ROLE_ATTEMPTS + 1):
                try:
                    await worker.client.set_role(role)
                    break
                except StillBusy:
                    # A submission in flight landed after the books read empty (several frontends report
                    # every 0.5 s): the worker changed nothing; drained again (no more grace), it is asked
                    # again, rather than taken for broken.
                    if attempt == SET_ROLE_ATTEMPTS:
                        raise
                    await wait_until_empty(worker, books, 0.0, timeout_s)
        except BaseException as error:
            if worker.state is not WorkerState.CHANGING_ROLE:  # it failed meanwhile: being replaced
                raise
            if is_sent:  # the actor may be in either role, or without a front: replace it
                why = f"its change to {role.value} failed: {type(error).__name__}"
                self.recovery.mark_failed(worker_id, why)
            else:
                logger.warning("%s: the change to %s stopped (%s); it stays %s", worker_id, role.value,
                               type(error).__name__, old.value)
                table.move_target(role, old)
                worker.next_role = old if is_unwired else None
                self._finish_role_change(worker, is_unwired)
            raise
        worker.role = role
        try:
            await self.wiring.connect([worker])
        except BaseException as error:
            if isinstance(error, Exception):
                why = f"its peers could not be told of it: {type(error).__name__}"
                self.recovery.mark_failed(worker_id, why)
            else:  # cancelled: the wiring finishes in the background
                self._finish_role_change(worker, is_unwired=True)
            raise
        self._finish_role_change(worker, is_unwired=False)

    def _finish_role_change(self, worker: Worker, is_unwired: bool) -> None:
        """ACTIVE in worker.role: at once if its peers know its endpoint, else once they are told it (in the
        background: the change was cancelled or stopped; a worker that cannot be wired is FAILED).
        next_role stays set until then: requests waiting for a worker in that role wait for it."""
        table = self.table
        if worker.state is not WorkerState.CHANGING_ROLE:  # it failed meanwhile: being replaced
            return
        if not is_unwired:
            transition(worker, WorkerState.ACTIVE)
            worker.next_role = None
            table.changed()
            return

        async def rewire() -> None:
            try:
                await self.wiring.connect([worker])
            except Exception as error:
                why = f"its peers could not be told of it: {type(error).__name__}"
                self.recovery.mark_failed(worker.worker_id, why)
                return
            if worker.state is WorkerState.CHANGING_ROLE:
                transition(worker, WorkerState.ACTIVE)
                worker.next_role = None
                table.changed()

        task = asyncio.get_running_loop().create_task(rewire(), context=contextvars.Context())
        self.rewiring.add(task)
        task.add_done_callback(self.rewiring.discard)
        table.changed()

    def _check_others_can_decode(self, leaving: Worker, new_role: Role | None = None) -> None:
        others = [w for w in self.table.workers.values() if w.is_active and w is not leaving]
        if leaving.is_active and not (new_role and new_role.can_decode) and not any(
                w.role.can_decode for w in others):
            raise LastDecoder(f"{leaving.worker_id} is the last active worker that can decode")

    async def drain_worker(self, worker_id: str, books: BooksOnTheWay | None = None,
                           grace_s: float = DRAIN_GRACE_S, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop routing to a worker, wait until it holds nothing, then stop it.

        Args:
            books: the routers' count of what they have sent the worker and not seen come back; a call
                on its way is not in the worker's load yet, so the drain also waits for this to be 0.
            grace_s: how long its decode streams may run on before they are evacuated to other workers.
        """
        table = self.table
        table.check_can_change()
        check_grace(grace_s, timeout_s)
        worker = table.workers[worker_id]
        self._check_others_can_decode(worker)
        transition(worker, WorkerState.DRAINING)
        table.move_target(worker.role, None)
        table.changed()
        try:
            await wait_until_empty(worker, books, grace_s, timeout_s)
        except BaseException as error:
            if worker.state is WorkerState.DRAINING:  # not failed meanwhile: it serves on
                logger.warning("%s: the drain stopped (%s); it stays", worker_id, type(error).__name__)
                transition(worker, WorkerState.ACTIVE)
                table.move_target(None, worker.role)
                table.changed()
            raise
        try:
            await worker.client.shutdown()
        finally:  # it holds nothing: whatever the shutdown call did, it goes
            table.forget(worker)
