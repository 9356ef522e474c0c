"""FleetActor: the fleet's owner as a named Ray actor, shared by every HTTP frontend of one gateway
(`pdserve serve`, with N ≥ 1 frontends: --api-server-count).

    FleetActor() → start(config, policy, auto): the deployment's workers placed, started and wired; the
        control plane (pool watch, resizer, ratio controller) running → FleetInfo
    frontends: info() once → view(after_version, epoch) (a long poll: the next snapshot once the fleet
        changed, or the same one after a while) → report() twice a second (their routers' counts, finished
        requests' timings: the controller's signals) → heartbeat() twice a second from a thread of their
        own (their liveness, which a busy event loop cannot starve) → note_prompt() for a long prompt (the
        controller looks at once) → mark_failed() when a call to a worker failed: the fleet confirms it
        with its own probe of the worker (load()) before it replaces anything, so that a failure seen by
        one frontend alone (its own streams cut) never costs a healthy worker
    admin: pools() / put_pools() / status(), as the ControlPlane answers them
    a frontend not heard for FRONTEND_SILENT_S is taken for dead: every worker ends its output channels,
        aborting what it was streaming to it (its admission shares died with its process); one that was
        only paused reads that its streams were closed, and starts its requests again
    shutdown(): every worker actor stopped.
It outlives any frontend: a frontend that dies loses only its own connections, and its restart joins the
same fleet. Should it die itself (a crash, Ray's memory monitor), Ray restarts it empty (max_restarts); its
workers, detached, live on (their streams with them); the supervisor sees it unstarted and starts it again
(gateway/frontends.py), which adopts them as they are (gateway/fleet/adoption.py: no weights load again), and
the frontends, whose /health says "unavailable" meanwhile, follow its new epoch. Killed for good, its workers
end themselves (worker_runtime/keeper_watch.py). The actor runs in the
supervisor's Ray job; the supervisor kills it at the end, unless it is a named fleet (--fleet-name): then it
is detached and outlives the supervisor too, and a supervisor started again with the same DeploymentConfig
(started_config()) rejoins it, workers and all (gateway/frontends.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

import ray

from gateway.control.messages import FleetInfo, FleetSnapshot, FrontendReport, WorkerEntry, frontend_prefix
from gateway.control.plane import ControlPlane, PlannerSettings, decode_kv_tokens, kv_tokens_by_worker
from gateway.control.reported_books import ReportedBooks
from gateway.fleet.bring_up_log import StartProgress, announce_kv
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.workers import WorkerState
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import ResizeRefused
from gateway.requests.router import LocalPrefillPolicy
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import RecentTraffic
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)

VIEW_POLL_S = 10.0  # a long poll answers after this even when nothing changed (the frontend asks again)
EXPIRY_CHECK_S = 1.0
CONFIRM_TIMEOUT_S = 10.0  # a reported worker that does not answer its load() probe within this is failed


class FleetActor:
    def __init__(self) -> None:
        self._plane: ControlPlane | None = None
        self._info: FleetInfo | None = None
        self._version = 0
        self._changed = asyncio.Event()
        self._recent = RecentLatencies()
        self._traffic = RecentTraffic()
        self._expiry: asyncio.Task[None] | None = None
        self._config: DeploymentConfig | None = None  # what start() was given: a rejoining gateway compares
        self._planning: PlannerSettings | None = None
        self._epoch = uuid.uuid4().hex[:12]  # a fresh one after Ray restarts this actor
        self._starting: PDDeployment | None = None  # while start() runs: start_progress() reads its log

    async def start(self, config: DeploymentConfig, policy: ControllerPolicy,
                    local_prefill: LocalPrefillPolicy, auto: bool, planning: PlannerSettings | None = None
                    ) -> FleetInfo:
        # Its workers outlive this actor, for a restart of it to adopt (gateway/fleet/adoption.py).
        deployment = PDDeployment(config, keeper=ray.get_runtime_context().get_actor_name())
        self._starting = deployment
        try:
            await deployment.start()
        finally:
            self._starting = None
        try:
            self._info = FleetInfo(config.engine.model_dir, min(await decode_kv_tokens(deployment)),
                                   deployment.block_size, deployment.backend.value)
            books = ReportedBooks(local_prefill, on_policy=self._bump)
            self._plane = ControlPlane(deployment, books, self._recent, policy, self._traffic, planning)
            self._plane.start(auto)
        except BaseException:
            await deployment.shutdown()
            raise
        deployment.on_change.append(self._bump)
        self._expiry = asyncio.create_task(self._expire_frontends())
        self._config, self._planning = config, planning
        announce_kv(list(deployment.workers.values()))
        return self._info

    async def rejoin(self, policy: ControllerPolicy, local_prefill: LocalPrefillPolicy, auto: bool,
                     planning: PlannerSettings | None) -> list[str]:
        """A supervisor started again over this fleet (same DeploymentConfig): its gateway-side settings
        (the controller's policy, the routers' local-prefill rule, auto on or off) are applied now; the
        planner's are fixed at start. Returns what changed, and what could not, for the supervisor to
        print."""
        plane, notes = self.plane, []
        if policy != plane.controller.policy:
            plane.controller.set_policy(policy)
            notes.append("the ratio controller's policy was changed")
        if not plane.controller.is_on and local_prefill != plane.books.local_prefill:
            plane.books.local_prefill = local_prefill
            notes.append("the local-prefill rule was changed")
        if auto != plane.is_auto:
            flag = "--scale" if plane.scaler is not None else "--ratio"
            try:
                if auto:
                    plane.start_auto()
                else:
                    await plane.stop_auto()
            except ResizeRefused as refused:
                notes.append(f"{flag} auto NOT applied: {refused}")
            else:
                notes.append(f"{flag} {'auto' if auto else 'fixed'} applied")
        if planning != self._planning:
            notes.append("the planner's settings differ and are NOT applied (they are fixed when the fleet "
                         "starts): `pdserve fleet stop` it, then serve again")
        return notes

    def start_progress(self) -> StartProgress | None:
        """How far start() has come (an async actor answers this while start() awaits its workers)."""
        return self._starting.bring_up_log.progress() if self._starting is not None else None

    def started_config(self) -> DeploymentConfig | None:
        """The settings this fleet started with; None: not started (or stopped)."""
        return self._config

    def _bump(self) -> None:
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()  # every waiter wakes; later ones wait anew
        changed.set()

    @property
    def plane(self) -> ControlPlane:
        if self._plane is None:
            raise RuntimeError("the fleet has not started")
        return self._plane

    def info(self) -> FleetInfo:
        if self._info is None:
            raise RuntimeError("the fleet has not started")
        return self._info

    async def view(self, after_version: int, epoch: str = "") -> FleetSnapshot:
        """The fleet, once its version is past `after_version` of `epoch` (or after VIEW_POLL_S, as it is);
        at once for a caller that knew another epoch."""
        if epoch == self._epoch and self._version <= after_version:
            with contextlib.suppress(TimeoutError):  # asyncio.timeout: a caller's cancel is never lost
                async with asyncio.timeout(VIEW_POLL_S):
                    await self._changed.wait()
        return self._snapshot()

    def _snapshot(self) -> FleetSnapshot:
        deployment = self.plane.deployment
        return FleetSnapshot(
            epoch=self._epoch,
            version=self._version,
            workers=tuple(WorkerEntry(w.worker_id, w.role.value, w.state.value,
                                      w.next_role.value if w.next_role else None, w.client.handle)
                          for w in deployment.workers.values()),
            replacing=tuple(role.value for role in Role if deployment.is_replacing(role)),
            health=deployment.health(),
            local_prefill=self.plane.books.local_prefill,
            long_prompt_tokens=self.plane.controller.policy.long_prompt_tokens)

    def report(self, report: FrontendReport) -> int:
        """A frontend's counts; answers its admission share (decode KV tokens it may reserve until its next
        report: ReportedBooks.admission_share over the live decode and mixed workers' capacity)."""
        books = self.plane.books
        if report.frontend_id not in books.frontends():
            logger.info("frontend %s joined", report.frontend_id)
        books.report(report)
        for timings in report.finished:
            self._recent.add(timings)
        for note in report.traffic:
            self._traffic.note(note)
        # What the active decode and mixed workers hold now (a PUT may have changed their degree since the
        # start), from the watch's latest loads; a worker not yet in them counts the start's size.
        deployment = self.plane.deployment
        config = deployment.config
        measured = kv_tokens_by_worker(deployment.last_loads, config.engine.block_size, config.watermark)
        at_start = self.info().kv_tokens_per_decode_worker
        held = [measured.get(w.worker_id, at_start) for w in deployment.active(Role.DECODE, Role.MIXED)]
        return books.admission_share(report.frontend_id, sum(held), floor=min(held, default=at_start))

    def heartbeat(self, frontend_id: str) -> bool:
        """A frontend is alive; False: the fleet does not know it (new, or taken for dead since)."""
        books = self.plane.books
        return books.heard(frontend_id)

    def note_prompt(self, num_tokens: int) -> None:
        self.plane.controller.note_prompt(num_tokens)

    async def mark_failed(self, worker_id: str, why: str) -> None:
        """A frontend saw a call to the worker fail: replace the worker if the fleet's own probe confirms
        it (no answer within CONFIRM_TIMEOUT_S, or a dead step loop); otherwise keep it and publish a
        snapshot, so that the frontend routes to it again."""
        deployment = self.plane.deployment
        worker = deployment.workers.get(worker_id)
        if worker is None:
            return
        try:
            load = await asyncio.wait_for(worker.client.load(), CONFIRM_TIMEOUT_S)
        except Exception as error:  # dead, or hung
            deployment.mark_failed(worker_id, f"{why}; its probe: {type(error).__name__}")
            return
        if load.failure:
            deployment.mark_failed(worker_id, load.failure)
            return
        logger.warning("worker %s was reported failed (%s) but answers its probe: it stays", worker_id, why)
        self._bump()

    async def pools(self) -> dict[str, object]:
        return await self.plane.pools()

    async def put_pools(self, layout: PoolLayout) -> dict[str, object]:
        return await self.plane.put_pools(layout)

    async def steps(self, worker_id: str, since: float) -> list[dict[str, object]]:
        return await self.plane.steps(worker_id, since)

    async def status(self) -> FleetStatus:
        return await self.plane.status()

    def frontends_exited(self, host: str, pids: list[int]) -> None:
        """Their supervisor saw these frontend processes exit: their streams end on every worker now (a
        silent one is waited for FRONTEND_SILENT_S: it may only be paused)."""
        if self._plane is None:  # not started (again) yet: no frontend has joined it
            return
        books = self.plane.books
        for frontend_id in books.forget([frontend_prefix(host, pid) for pid in pids]):
            print(f"pdserve: frontend {frontend_id} exited: its streams end on every worker", flush=True)
            self._end_frontend(frontend_id)

    async def _expire_frontends(self) -> None:
        books = self.plane.books
        while True:
            await asyncio.sleep(EXPIRY_CHECK_S)
            for frontend_id in books.expire():
                logger.warning("frontend %s is silent: taken for dead; its streams end on every worker",
                               frontend_id)
                self._end_frontend(frontend_id)

    def _end_frontend(self, frontend_id: str) -> None:
        for worker in list(self.plane.deployment.workers.values()):
            if worker.state not in (WorkerState.PENDING, WorkerState.FAILED):
                worker.client.close_channels(frontend_id)

    async def shutdown(self) -> None:
        self._config = self._planning = None
        if self._expiry is not None:
            self._expiry.cancel()
        if self._plane is not None:
            await self._plane.stop()
