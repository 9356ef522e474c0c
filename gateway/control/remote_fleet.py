"""A frontend's side of the fleet, which the fleet actor owns (every `pdserve serve` runs N ≥ 1 frontends).

RemoteFleet is the FleetView the frontend's request path runs on:
    join() → (the fleet started: a frontend started while the fleet actor restarts waits for the supervisor
      to start it again) → FleetInfo → the first snapshot → the first admission share (an empty report)
    start(router, admission) once the request path is built over it → a heartbeat thread and two tasks for
      the frontend's life:
      heartbeat (a thread, so that a busy event loop cannot starve it): twice a second tells the fleet this
              frontend lives, and notes when the fleet last answered: a fleet silent for FLEET_SILENT_S
              (dead, or paused) turns /health "unavailable" (503) until it answers again
      follow: long-polls view(version); a snapshot of a new epoch (the fleet actor was restarted and its
              fleet started again) replaces the mirror whatever its version;
              each snapshot updates the mirror: a worker new to it gets this
              frontend's own WorkerClient (its own output stream and submissions, under this frontend's
              gateway id); one gone from it is closed and forgotten (on_remove); a role change is
              on_remove too (the router forgets its prefix-cache beliefs); the router takes the
              snapshot's local-prefill policy
      report: twice a second, this frontend's routers' counts, its admission book and its finished
              requests' timings (the fleet's controller reads them); the answer is this frontend's admission
              share until the next report (the admission's capacity)
    mark_failed(): the worker leaves this frontend's routing at once, and the fleet is told: it probes the
      worker and replaces it if the probe confirms the failure
    note_prompt / note_finished / note_traffic: what the request path tells the fleet's controller
The mirror's states are the fleet's: only the fleet moves a worker through its lifecycle.
Every call to the fleet actor goes through its FleetClient (gateway/control/fleet_client.py), which is also
the admin routes' FleetControl in a frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from ray.exceptions import RayActorError

from gateway.control.fleet_client import FleetClient
from gateway.control.messages import FleetInfo, FleetSnapshot, FrontendReport
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import PoolHealth, Worker, WorkerState
from gateway.requests.admission import Admission
from gateway.requests.router import LocalPrefillPolicy, Router
from gateway.telemetry.timings import Timings
from gateway.telemetry.traffic import TrafficNote
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)

REPORT_S = 0.5
HEARTBEAT_S = 0.5
FLEET_SILENT_S = 5.0  # the fleet actor has not answered a heartbeat for this long: /health says so
FOLLOW_RETRY_S = 1.0
REPORT_TIMEOUT_S = 5.0
JOIN_RETRY_S = 1.0
REPORTED_FAILED_S = 15.0  # the fleet's probe of a reported worker (10 s at most) and its next snapshot


class RemoteFleet:
    def __init__(self, fleet: FleetClient, frontend_id: str) -> None:
        """Args:
        fleet: the fleet actor's client.
        frontend_id: names this frontend to the workers (the prefix of its output channels) and the fleet.
        """
        self.fleet = fleet
        self.frontend_id = frontend_id
        self.fleet_heard_at = time.monotonic()  # when the fleet last answered a heartbeat
        self._stopping = threading.Event()
        self._view_failing_since: float | None = None  # the follow loop's view calls fail (since when)
        self._heartbeat: threading.Thread | None = None
        self.workers: dict[str, Worker] = {}
        self.on_remove: list[Callable[[str], None]] = []
        self._router: Router | None = None  # set by start(): its policy follows the fleet's
        self._admission: Admission | None = None  # set by start(): its book goes in every report
        self.info: FleetInfo | None = None
        self._snapshot: FleetSnapshot | None = None
        self._long_prompt = 0  # the longest prompt noted since the last report (0: none)
        self._report_now = asyncio.Event()  # a long prompt: report now, then tell it
        self._reported_failed: dict[str, tuple[Role, float]] = {}  # worker id → (its role, when reported)
        self._finished: list[Timings] = []
        self._traffic: list[TrafficNote] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def block_size(self) -> int:
        assert self.info is not None, "start() first"
        return self.info.block_size

    async def join(self) -> tuple[FleetInfo, int]:
        """The fleet's info, and this frontend's first admission share (decode KV tokens)."""
        while True:
            await self._until_fleet_started()
            try:
                self.info = await self.fleet.info()
                snapshot = await self.fleet.view(-1, "")
                share = await self.fleet.report(self._build_report())
                break
            except RayActorError:  # it died again just now: wait for it again
                continue
        self._apply(snapshot)
        self.fleet_heard_at = time.monotonic()
        return self.info, share

    def start(self, router: Router, admission: Admission) -> None:
        """Report `router`'s counts and `admission`'s book, set its capacity to each share the fleet answers,
        follow the fleet's snapshots (`router` takes their local-prefill policy), send heartbeats."""
        self._router, self._admission = router, admission
        self._tasks = [asyncio.create_task(self._follow(), name="fleet-follow"),
                       asyncio.create_task(self._report(), name="fleet-report")]
        self._heartbeat = threading.Thread(target=self._beat, name="fleet-heartbeat", daemon=True)
        self._heartbeat.start()

    async def _until_fleet_started(self) -> None:
        """Wait while the fleet actor is restarting, or restarted and not started again yet. Failing this
        frontend's startup instead (info(): "the fleet has not started") would make uvicorn's supervisor
        stop the whole server ("failed to start"), every frontend with it. A fleet gone for good is the
        supervisor's to end (gateway/frontends.py): it stops this frontend then."""
        is_told = False
        while True:
            try:
                if await self.fleet.started_config() is not None:
                    return
            except RayActorError:  # restarting (ActorUnavailableError is one)
                pass
            if not is_told:
                logger.warning("the fleet is not started (it is restarting): this frontend waits for it")
                is_told = True
            await asyncio.sleep(JOIN_RETRY_S)

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # stop() itself stays cancellable
        for worker in self.workers.values():
            worker.client.close()

    # FleetView.
    def active(self, *roles: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role in roles and w.state is WorkerState.ACTIVE]

    def is_replacing(self, *roles: Role) -> bool:
        """The fleet's snapshot says so, or this frontend reported a worker of the role failed in the last
        REPORTED_FAILED_S: the fleet is confirming it (its probe takes up to 10 s) and will start its
        replacement, which the next snapshot shows; meanwhile requests wait for it rather than fail."""
        now = time.monotonic()
        self._reported_failed = {w: (role, at) for w, (role, at) in self._reported_failed.items()
                                 if now - at < REPORTED_FAILED_S}
        if any(role in roles for role, _ in self._reported_failed.values()):
            return True
        return self._snapshot is not None and any(Role(r) in roles for r in self._snapshot.replacing)

    def mark_failed(self, worker_id: str, why: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is None or worker.state is not WorkerState.ACTIVE:
            return
        worker.state = WorkerState.FAILED  # out of this frontend's routing until the fleet says otherwise
        self._reported_failed[worker_id] = (worker.next_role or worker.role, time.monotonic())
        self.fleet.mark_failed(worker_id, why)

    @property
    def local_prefill(self) -> LocalPrefillPolicy:
        """The routers' policy, as the fleet sets it."""
        assert self._snapshot is not None, "start() first"
        return self._snapshot.local_prefill

    def health(self) -> PoolHealth:
        assert self._snapshot is not None, "start() first"
        silent_s = time.monotonic() - self.fleet_heard_at
        if silent_s > FLEET_SILENT_S:
            return dataclasses.replace(self._snapshot.health, status="unavailable",
                                       reason=f"the fleet has not answered for {silent_s:.0f} s")
        if self._view_failing_since is not None:  # its workers as this mirror holds them may be gone
            return dataclasses.replace(self._snapshot.health, status="unavailable",
                                       reason="the fleet is starting again")
        return self._snapshot.health

    # What this frontend tells the fleet.
    def note_prompt(self, num_tokens: int) -> None:
        """A prompt was routed (or a decode worker started prefilling one): a long one is told at once, right
        after a report of the counts that place it (the controller's tick reads them as it wakes)."""
        if self._snapshot is not None and num_tokens >= self._snapshot.long_prompt_tokens:
            self._long_prompt = max(self._long_prompt, num_tokens)
            self._report_now.set()

    def note_finished(self, timings: Timings) -> None:
        self._finished.append(timings)

    def note_traffic(self, note: TrafficNote) -> None:
        """A request arrived or finished here (the fleet's planners count it from its arrival)."""
        self._traffic.append(note)

    # The heartbeat thread and the two loops.
    def _beat(self) -> None:
        while not self._stopping.wait(HEARTBEAT_S):
            try:
                is_known = self.fleet.heartbeat(self.frontend_id, FLEET_SILENT_S)
            except Exception:  # gone, paused, restarting or not started again yet: /health tells
                continue
            self.fleet_heard_at = time.monotonic()
            if not is_known:
                logger.info("the fleet did not know this frontend (new to it, or taken for dead): joined")

    # Both loops also end on `_stopping`: Python 3.11's asyncio.wait_for loses a cancellation that lands as
    # its inner await finishes (fixed in 3.12), and a loop that lost stop()'s one cancel ran for ever, holding
    # the frontend's shutdown (a test server that never stopped, twice in full test runs).
    async def _follow(self) -> None:
        while not self._stopping.is_set():
            try:
                snapshot = await self.fleet.view(*self._seen())
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the fleet actor is gone or restarting: try again
                if self._view_failing_since is None:
                    self._view_failing_since = time.monotonic()
                    logger.warning("fleet view failed: %s", type(error).__name__)  # once, not every second
                await asyncio.sleep(FOLLOW_RETRY_S)
                continue
            self._apply(snapshot)
            if self._view_failing_since is not None:
                logger.warning("the fleet answers again after %.1f s",
                               time.monotonic() - self._view_failing_since)
                self._view_failing_since = None

    async def _report(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):  # every REPORT_S, or at once for a long prompt
                async with asyncio.timeout(REPORT_S):  # not wait_for: see above
                    await self._report_now.wait()
            self._report_now.clear()
            long_prompt, self._long_prompt = self._long_prompt, 0
            try:
                report = self._build_report()
                share = await asyncio.wait_for(self.fleet.report(report), REPORT_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # gone, paused, restarting: the last share stands (the heartbeat tells /health)
                continue
            finally:
                if long_prompt:
                    self.fleet.note_prompt(long_prompt)
            if self._admission is not None and share != self._admission.capacity_tokens:
                self._admission.set_capacity(share)

    def _seen(self) -> tuple[int, str]:
        """The latest snapshot's version and epoch (the long poll answers once the fleet is past them)."""
        return (self._snapshot.version, self._snapshot.epoch) if self._snapshot is not None else (-1, "")

    def _build_report(self) -> FrontendReport:
        finished, self._finished = self._finished, []
        traffic, self._traffic = self._traffic, []
        router, admission = self._router, self._admission
        reserved, waiting = (admission.reserved_tokens, admission.waiting_tokens) if admission else (0, 0)
        if router is None:
            return FrontendReport(self.frontend_id, {}, {}, {}, 0, 0, finished, traffic, reserved, waiting)
        in_flight = {worker_id: router.in_flight(worker_id) for worker_id in self.workers}
        return FrontendReport(
            self.frontend_id, {w: n for w, n in in_flight.items() if n},
            {w: n for w, n in router.prefill_tokens.items() if n},
            {w: n for w, n in router.local_prefill_tokens.items() if n},
            router.longest_local_prefill(), router.longest_prefill_beside_streams(), finished, traffic,
            reserved, waiting)

    def _apply(self, snapshot: FleetSnapshot) -> None:
        """The mirror takes the snapshot's workers, roles and states."""
        if self._snapshot is not None and snapshot.epoch == self._snapshot.epoch and (
                snapshot.version < self._snapshot.version):
            return
        seen = set()
        for entry in snapshot.workers:
            seen.add(entry.worker_id)
            role, state = Role(entry.role), WorkerState(entry.state)
            worker = self.workers.get(entry.worker_id)
            if worker is None:
                client = WorkerClient(entry.worker_id, entry.handle, self.frontend_id)
                worker = self.workers[entry.worker_id] = Worker(entry.worker_id, role, client, state)
            elif worker.role is not role:
                for callback in self.on_remove:
                    callback(entry.worker_id)
            worker.role, worker.state = role, state
            worker.next_role = Role(entry.next_role) if entry.next_role else None
        for worker_id in [w for w in self.workers if w not in seen]:
            self.workers.pop(worker_id).client.close()
            for callback in self.on_remove:
                callback(worker_id)
        self._snapshot = snapshot
        if self._router is not None:
            self._router.local_prefill = snapshot.local_prefill

