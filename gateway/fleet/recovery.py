"""Recovery: noticing a failed worker and starting one in its place.

    ACTIVE | DRAINING | CHANGING_ROLE → FAILED: mark_failed() (the fleet actor, once its own probe confirms
    a failure a frontend reported: gateway/control/fleet_actor.py; loads() finds one that does not answer,
    reports a failure, or whose step is hung) takes it out of routing at once. A draining worker is then
    just forgotten; any other is forgotten and a new worker of its role (its next role, if it was changing)
    is started by start_until_up(), retried with backoff until one is up: it may stay PENDING for as long
    as no node can take it.
    start_late(): the workers start() went on without (still PENDING) are brought up by start_until_up too.
    watch() polls loads() once a second, so that a worker that dies while idle is noticed too.
With a torch group (fixed at start) a failed worker is not replaced.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from typing import TYPE_CHECKING

from gateway.fleet.workers import Worker, WorkerState, transition
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from gateway.fleet.table import WorkerTable

logger = logging.getLogger(__name__)

# A worker that does not answer a load query for this long is taken for dead (a dead actor fails at once).
LOAD_TIMEOUT_S = 30.0
STEP_WATCHDOG_FACTOR = 10.0  # a step 10× the worker's longest finished one (and past the floor) is hung


class Recovery:
    """Owns the failed workers' replacements and the workers still starting after start() went on."""

    def __init__(self, table: WorkerTable, step_watchdog_s: float) -> None:
        """Args:
            table: the fleet's workers: it creates, brings up and forgets them.
            step_watchdog_s: the floor under which no running step counts as hung (0: none does).
        """
        self.table = table
        self.step_watchdog_s = step_watchdog_s
        # Failed worker id → (that worker, the task starting its replacement).
        self.replacements: dict[str, tuple[Worker, asyncio.Task[None]]] = {}
        self.late_starts: list[asyncio.Task[None]] = []  # workers still pending when start() went on
        self.late_workers: list[Worker] = []  # and those workers
        self.last_loads: list[WorkerLoad] = []  # from the latest loads() (watch() refreshes it every second)

    def tasks(self) -> list[asyncio.Task[None]]:
        """Every start still running (shutdown cancels them)."""
        return [*(task for _, task in self.replacements.values()), *self.late_starts]

    def start_late(self, workers: list[Worker]) -> None:
        """Bring up, in the background, the `workers` start() went on without (still PENDING)."""
        self.late_workers = workers
        self.late_starts = [asyncio.create_task(self.start_until_up(w.role, "start-up", w)) for w in workers]

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Take a worker out of routing at once and start its replacement (idempotent)."""
        table = self.table
        worker = table.workers.get(worker_id)
        # PENDING and STARTING workers are their bring-up's to clean up; FAILED and STOPPED ones are done.
        if worker is None or worker.state in (WorkerState.FAILED, WorkerState.PENDING, WorkerState.STARTING,
                                              WorkerState.STOPPED):
            return
        logger.error("worker %s failed: %s", worker_id, why)
        was_draining = worker.state is WorkerState.DRAINING
        transition(worker, WorkerState.FAILED)
        table.changed()
        if table.is_closing:
            return
        if not table.can_change:
            logger.error("the %s transfer backend fixes its workers at start: %s is not replaced",
                         table.backend, worker_id)
            return
        if was_draining:  # it was leaving anyway: remove it, start nothing
            table.forget(worker)
            return
        # Not the request's that noticed the failure (its log lines' request id): an empty context.
        replacing = asyncio.create_task(self._replace(worker), context=contextvars.Context())
        self.replacements[worker_id] = (worker, replacing)

    def is_replacing(self, *roles: Role) -> bool:
        """Whether a worker in any of `roles` is being started in place of a failed one, or is one start()
        went on without (a restarted fleet's in place of one lost with its node): requests wait for it."""
        coming = (WorkerState.PENDING, WorkerState.STARTING)
        return (any((w.next_role or w.role) in roles for w, _ in self.replacements.values())
                or any(w.role in roles and w.state in coming for w in self.late_workers))

    async def _replace(self, failed: Worker) -> None:
        self.table.forget(failed)
        role = failed.next_role or failed.role  # a worker that failed while changing role: its new role
        await self.start_until_up(role, failed.worker_id)
        self.replacements.pop(failed.worker_id, None)

    async def start_until_up(self, role: Role, instead_of: str, worker: Worker | None = None,
                             first_retry_s: float = 1.0) -> None:
        """Bring a worker in `role` up, retrying with backoff until one is; it may stay PENDING for as long
        as no node can take it (a lost node's replacement waits for capacity to return)."""
        table = self.table
        retry_s = first_retry_s
        while not table.is_closing:
            worker = worker or table.create(role)
            try:
                await table.bring_up(worker)
            except BaseException as error:
                if not isinstance(error, Exception):  # cancelled (shutdown): nothing half started stays
                    table.forget(worker)
                    raise
                logger.error("worker %s (for %s) did not start (%s: %s); retrying in %.0f s",
                             worker.worker_id, instead_of, type(error).__name__, error, retry_s)
                table.forget(worker)
                worker = None
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, 30.0)
                continue
            logger.warning("worker %s is up (for %s) on %s", worker.worker_id, instead_of, worker.node_ip)
            break

    async def watch(self, interval_s: float = 1.0) -> None:
        """Poll every worker's load forever, so that a worker that died while idle is noticed and replaced."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.loads()
            except Exception:  # the watcher itself must never die
                logger.exception("pool watch failed")

    async def loads(self) -> list[WorkerLoad]:
        """Loads of the live workers; a worker that is dead or reports a failure is marked failed."""
        live = (WorkerState.ACTIVE, WorkerState.DRAINING, WorkerState.CHANGING_ROLE)
        workers = [w for w in self.table.workers.values() if w.state in live]
        answers = await asyncio.gather(
            *(asyncio.wait_for(w.client.load(), LOAD_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        loads = []
        for worker, answer in zip(workers, answers, strict=True):
            if isinstance(answer, BaseException):
                self.mark_failed(worker.worker_id, f"no load report: {type(answer).__name__}")
            elif answer.failure:
                self.mark_failed(worker.worker_id, answer.failure)
            elif hung := self._hung(answer):
                self.mark_failed(worker.worker_id, hung)
            else:
                loads.append(answer)
                runtime = worker.runtime
                if runtime is not None and answer.compile and answer.compile != runtime.compile:
                    # A body compiled beside serving was swapped in (or its compile failed): as it runs now.
                    logger.info("%s: model body %s (%s)", worker.worker_id, answer.compile,
                                answer.compile_reason)
                    worker.runtime = dataclasses.replace(runtime, compile=answer.compile,
                                                         compile_reason=answer.compile_reason)
                    self.table.changed()
        self.last_loads = loads
        return loads

    def _hung(self, load: WorkerLoad) -> str:
        """Why the worker's running step counts as hung (empty: it does not): it has run past both the
        configured floor and STEP_WATCHDOG_FACTOR times the longest step the worker has finished, so a
        worker whose steps are slow by nature (long prefill chunks on a CPU) is judged by its own."""
        floor = self.step_watchdog_s
        if not floor:
            return ""
        bound = max(floor, STEP_WATCHDOG_FACTOR * load.longest_step_s)
        if load.step_running_s <= bound:
            return ""
        return (f"hung: its step has run {load.step_running_s:.0f} s (its longest finished step "
                f"{load.longest_step_s:.1f} s; bound {bound:.0f} s)")
