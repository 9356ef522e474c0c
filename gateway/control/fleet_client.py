"""FleetClient: the one typed way to the fleet actor (gateway/control/fleet_actor.py).

Every call to the actor goes through it, so that its methods, their types and the errors callers see are
written once:
    the frontend's event loop (RemoteFleet): info, view, started_config, report (awaited); mark_failed,
      note_prompt (sent, not awaited)
    the frontend's heartbeat thread: heartbeat (blocking, with a timeout)
    the admin routes (FleetControl): pools, put_pools, status, steps; a refusal raises as itself (the API
      maps it to 400 or 409), a fleet actor restarting or not started again is RequestFailed
      FailureCode.FLEET_UNAVAILABLE (503)
    the supervisor (gateway/frontends.py, pdserve fleet): start, rejoin, probe_started, shutdown, kill
      (blocking: it runs no event loop of its own), frontends_exited (sent); start_progress (from its
      start answerer's thread, while start runs)
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from gateway.control.messages import FleetInfo, FleetSnapshot, FrontendReport
from gateway.fleet.bring_up_log import StartProgress
from gateway.fleet.ray_calls import translated
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import ResizeConflict, ResizeRefused
from gateway.requests.events import FailureCode, RequestFailed
from gateway.requests.router import LocalPrefillPolicy
from gateway.telemetry.fleet_metrics import FleetStatus

if TYPE_CHECKING:
    from gateway.control.plane import PlannerSettings
    from gateway.fleet.config import DeploymentConfig

T = TypeVar("T")

FLEET_RESTARTING = "the fleet is starting again (its actor restarted): try again shortly"


class FleetClient:
    """Wraps the fleet actor's handle (ActorHandle[FleetActor]; `Any` here alone, as Ray types its methods
    loosely)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    # The frontend's event loop.
    async def info(self) -> FleetInfo:
        info: FleetInfo = await self.handle.info.remote()
        return info

    async def view(self, after_version: int, epoch: str) -> FleetSnapshot:
        """The fleet's next snapshot past (after_version, epoch): a long poll."""
        snapshot: FleetSnapshot = await self.handle.view.remote(after_version, epoch)
        return snapshot

    async def started_config(self) -> DeploymentConfig | None:
        """The settings the fleet started with; None: not started (a fresh or restarted actor)."""
        config: DeploymentConfig | None = await self.handle.started_config.remote()
        return config

    async def report(self, report: FrontendReport) -> int:
        """Sends this frontend's counts; answers its admission share until the next report."""
        share: int = await self.handle.report.remote(report)
        return share

    def mark_failed(self, worker_id: str, why: str) -> None:
        """Tells the fleet a worker's call failed (it confirms, then replaces it); not awaited."""
        self.handle.mark_failed.remote(worker_id, why)

    def note_prompt(self, num_tokens: int) -> None:
        """Tells the fleet's controller a long prompt was routed; not awaited."""
        self.handle.note_prompt.remote(num_tokens)

    # The heartbeat thread.
    def heartbeat(self, frontend_id: str, timeout_s: float) -> bool:
        """Whether the fleet knew this frontend already. Raises whatever Ray raises (gone, timed out)."""
        is_known: bool = ray.get(self.handle.heartbeat.remote(frontend_id), timeout=timeout_s)
        return is_known

    # The admin routes (FleetControl).
    async def pools(self) -> dict[str, object]:
        return await self._admin(self.handle.pools.remote())

    async def put_pools(self, layout: PoolLayout) -> dict[str, object]:
        return await self._admin(self.handle.put_pools.remote(layout))

    async def status(self) -> FleetStatus:
        return await self._admin(self.handle.status.remote())

    async def steps(self, worker_id: str, since: float) -> list[dict[str, object]]:
        return await self._admin(self.handle.steps.remote(worker_id, since))

    @staticmethod
    async def _admin(call: Awaitable[T]) -> T:
        """The fleet's refusals raise here as themselves (the API maps them to 400 and 409); a fleet actor
        that is restarting, or not started again yet, is a 503 that says so (not "a worker failed")."""
        unavailable = FailureCode.FLEET_UNAVAILABLE
        return await translated(call, lambda _: RequestFailed(FLEET_RESTARTING, unavailable), _admin_cause)

    # The supervisor (blocking).
    def start(self, config: DeploymentConfig, policy: ControllerPolicy, local_prefill: LocalPrefillPolicy,
              auto: bool, planning: PlannerSettings | None) -> FleetInfo:
        """Starts the fleet's workers and control plane; returns once they serve."""
        info: FleetInfo = ray.get(self.handle.start.remote(config, policy, local_prefill, auto, planning))
        return info

    def rejoin(self, policy: ControllerPolicy, local_prefill: LocalPrefillPolicy, auto: bool,
               planning: PlannerSettings | None) -> list[str]:
        """A supervisor started again over a running fleet: its settings applied; returns what changed."""
        notes: list[str] = ray.get(self.handle.rejoin.remote(policy, local_prefill, auto, planning))
        return notes

    def start_progress(self, timeout_s: float = 2.0) -> StartProgress | None:
        """How far the fleet's start() has come (None: not running it); for /health while it runs. Raises
        GetTimeoutError past timeout_s."""
        progress: StartProgress | None = ray.get(self.handle.start_progress.remote(), timeout=timeout_s)
        return progress

    def frontends_exited(self, host: str, pids: list[int]) -> None:
        """These frontend processes on `host` exited (sent, not awaited: the fleet ends their streams)."""
        self.handle.frontends_exited.remote(host, pids)

    def probe_started(self, timeout_s: float | None = None) -> DeploymentConfig | None:
        """started_config, blocking. Raises GetTimeoutError past timeout_s, RayActorError if it died."""
        config: DeploymentConfig | None = ray.get(self.handle.started_config.remote(), timeout=timeout_s)
        return config

    def shutdown(self, timeout_s: float) -> None:
        """Stops the fleet's workers (raises if it does not answer by timeout_s)."""
        ray.get(self.handle.shutdown.remote(), timeout=timeout_s)

    def kill(self) -> None:
        ray.kill(self.handle)


def _admin_cause(cause: BaseException) -> BaseException | None:
    if isinstance(cause, (ResizeRefused, ResizeConflict, ValueError, KeyError)):
        return cause
    if isinstance(cause, RuntimeError) and "has not started" in str(cause):
        return RequestFailed(FLEET_RESTARTING, FailureCode.FLEET_UNAVAILABLE)
    return None
