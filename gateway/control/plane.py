"""ControlPlane: the fleet's owner. It holds the deployment (every worker actor), the resizer and the ratio
controller, runs the pool watch, and answers the admin routes and the fleet's metrics.

    start(auto) after the deployment is up: pool watch (every second: loads; dead workers replaced)
                → if auto: the scale controller (--scale auto: the fleet's size and split), else the
                  ratio controller (--ratio auto: its split)
    pools() / put_pools(layout): GET and PUT /admin/pools
    status(): the fleet's series for /metrics (gateway/telemetry/fleet_metrics.py)
    stop() → the deployment's shutdown (every actor)
It lives in the fleet actor (gateway/control/fleet_actor.py), its books summed from the frontends' reports
(gateway/control/reported_books.py). FleetControl is what the admin routes call: a frontend's client of the
actor (gateway/control/fleet_client.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, replace
from typing import Protocol

import ray

from gateway.control.reported_books import ReportedBooks
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.placement import pending_reason
from gateway.fleet.workers import WorkerState
from gateway.ratio.controller import RatioController
from gateway.ratio.ladder import ControllerPolicy, Decision
from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import PoolResizer, ResizeRefused
from gateway.ratio.scaler import ScaleController
from gateway.ratio.sizing import ScalePolicy, candidate_layouts
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import RecentTraffic
from loadgen.summary import SLO
from tuner.profile import load_profile
from tuner.simulator import SimConfig
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role


class FleetControl(Protocol):
    async def pools(self) -> dict[str, object]: ...

    async def put_pools(self, layout: PoolLayout) -> dict[str, object]: ...

    async def status(self) -> FleetStatus: ...

    async def steps(self, worker_id: str, since: float) -> list[dict[str, object]]: ...


def decision_summary(decision: Decision) -> dict[str, object]:
    summary: dict[str, object] = {
        "at": decision.at, "from_level": decision.from_level, "to_level": decision.to_level,
        "reason": decision.reason, "detail": decision.detail,
        "queued_prompt_tokens": decision.signals.queued_prompt_tokens}
    if decision.prediction is not None:
        summary |= {"prediction": decision.prediction, "measured": decision.measured or None}
    return summary


@dataclass(frozen=True)
class PlannerSettings:
    """What the planner needs beyond the live deployment: a worker's profile and the admission settings
    the simulation mirrors."""

    profile_path: str  # from `pdserve tune profile`
    max_waiting: int
    queue_timeout_s: float
    isolate_prompts_from_tokens: int  # the router's (LocalPrefillPolicy)
    move_streams_from_tokens: int  # the router's (LocalPrefillPolicy)
    scale: ScalePolicy | None = None  # --scale auto: the sizes the scale controller chooses between


def build_planner(settings: PlannerSettings, deployment: PDDeployment, policy: ControllerPolicy
                  ) -> LayoutPlanner:
    """The planner over the layouts the controller may choose (with --scale auto every layout of every size
    in range, else the ladder's layouts of the deployment's workers), priced by the profile's fits, with
    the live workers' KV shape and budgets."""
    profile = load_profile(settings.profile_path)
    engine = deployment.config.engine
    decoding = [x for x in deployment.last_loads if Role(x.role).can_decode] or deployment.last_loads
    shape = replace(profile.shape, block_size=engine.block_size,
                    num_blocks=min((x.num_total_blocks for x in decoding), default=profile.shape.num_blocks),
                    max_num_batched_tokens=engine.max_num_batched_tokens, max_num_seqs=engine.max_num_seqs)
    config = SimConfig(shape, deployment.config.watermark, settings.max_waiting, settings.queue_timeout_s,
                       max_prefill_s_beside_decode=engine.max_prefill_s_beside_decode,
                       isolate_prompts_from_tokens=settings.isolate_prompts_from_tokens,
                       move_streams_from_tokens=settings.move_streams_from_tokens)
    slo = SLO(policy.ttft_slo_s, policy.itl_slo_s)
    if settings.scale is not None:
        return LayoutPlanner(profile.fits, config, slo, settings.scale.candidates,
                             min_requests=settings.scale.min_requests)
    return LayoutPlanner(profile.fits, config, slo, candidate_layouts([sum(deployment.target.values())]))


def kv_tokens_by_worker(loads: list[WorkerLoad], block_size: int, watermark: float) -> dict[str, int]:
    """KV tokens each decode or mixed worker in `loads` can hold (less its watermark): admission's capacity,
    and the longest request one worker can take. Every worker runs the same engine settings: a restarted
    fleet whose decode workers are all pending (their node lost) reads the live prefill workers' instead.
    Read off the loads, so that a worker replaced at another tensor-parallel degree counts what it holds."""
    decoding = [x for x in loads if Role(x.role).can_decode] or loads
    return {x.worker_id: int(x.num_total_blocks * block_size * (1.0 - watermark)) for x in decoding}


async def decode_kv_tokens(deployment: PDDeployment) -> list[int]:
    """kv_tokens_by_worker over loads asked for now (at start, before the watch has any).

    Raises:
        RuntimeError: no worker answered.
    """
    config = deployment.config
    tokens = kv_tokens_by_worker(await deployment.loads(), config.engine.block_size, config.watermark)
    if not tokens:
        raise RuntimeError("no worker of the fleet answered for its KV capacity")
    return list(tokens.values())


class ControlPlane:
    def __init__(self, deployment: PDDeployment, books: ReportedBooks, recent: RecentLatencies,
                 policy: ControllerPolicy, traffic: RecentTraffic | None = None,
                 planning: PlannerSettings | None = None) -> None:
        """Args:
        deployment: started.
        books: the frontends' routers' counts (queued prompts, what is on its way to each worker).
        recent: finished requests' latencies (the controller's TTFT and ITL).
        traffic, planning: the recent arrivals, and the settings of the planner that replays them (with
            --profile); with a scale policy in them the scale controller sizes the fleet, else the ratio
            controller moves its workers between roles.
        """
        self.deployment = deployment
        self.books = books
        self.resizer = PoolResizer(deployment, books)
        planner = build_planner(planning, deployment, policy) if planning is not None else None
        self.scaler: ScaleController | None = None
        if planning is not None and planning.scale is not None:
            assert planner is not None and traffic is not None
            self.scaler = ScaleController(deployment, self.resizer, recent, traffic, planner, planning.scale,
                                          policy.ttft_slo_s, policy.itl_slo_s)
            planner = None  # the ratio controller, should the operator turn it on, keeps to its rules
        self.controller = RatioController(deployment, books, self.resizer, recent, policy, planner=planner,
                                          traffic=traffic)
        self._watch: asyncio.Task[None] | None = None

    def start(self, auto: bool) -> None:
        """The pool watch, and with `auto` the scale controller if one is set, else the ratio controller."""
        if auto and not self.deployment.can_change:
            raise ValueError(f"--ratio auto and --scale auto need workers that can change role; the "
                             f"{self.deployment.backend} backend fixes them at start (use --backend nixl)")
        self._watch = asyncio.create_task(self.deployment.watch())
        if auto:
            self.start_auto()

    def start_auto(self) -> None:
        """The scale controller if one is set, else the ratio controller, on.

        Raises:
            ResizeRefused: the roles start at different tensor-parallel degrees (auto moves workers between
                roles, and a worker's ranks are fixed at its start): by PUT or by a rejoin alike.
        """
        prefill_tp, decode_tp = (self.deployment.config.tp_of(r) for r in (Role.PREFILL, Role.DECODE))
        if prefill_tp != decode_tp:
            raise ResizeRefused(f"prefill workers start at tensor-parallel degree {prefill_tp} and decode "
                                f"workers at {decode_tp}: auto moves workers between roles, and a worker's "
                                "ranks are fixed at its start; PUT one degree for both first")
        (self.scaler or self.controller).start()

    @property
    def is_auto(self) -> bool:
        return self.controller.is_on or (self.scaler is not None and self.scaler.is_on)

    async def stop_auto(self) -> None:
        """Both controllers off; a change either was applying is rolled back first."""
        if self.scaler is not None:
            await self.scaler.stop()
        await self.controller.stop()

    async def stop(self) -> None:
        """The controller and the watch stop, then every worker actor."""
        try:
            await self.stop_auto()
            if self._watch is not None:
                self._watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._watch
        finally:
            await self.deployment.shutdown()

    async def status(self) -> FleetStatus:
        """The fleet's series, from the pool watch's latest round (at most a second old)."""
        workers = list(self.deployment.workers.values())
        return FleetStatus(
            loads=list(self.deployment.last_loads),
            runtimes={w.worker_id: w.runtime for w in workers
                      if w.runtime is not None and w.state is not WorkerState.FAILED},
            active=dict(self.deployment.health().active),
            ratio_changes=dict(self.controller.changes),
            scale_changes=dict(self.scaler.changes) if self.scaler is not None else {})

    async def pools(self) -> dict[str, object]:
        """GET /admin/pools: each worker's role, state, node, load and KV capacity; the layout aimed at; a
        change in progress; the ratio controller's state and its recent decisions."""
        deployment, controller = self.deployment, self.controller
        loads = {x.worker_id: x for x in await deployment.loads()}
        pools = deployment.health()
        workers: list[dict[str, object]] = []
        available: dict[str, float] | None = None  # Ray's free resources, read once if a worker is pending
        for worker in list(deployment.workers.values()):
            entry: dict[str, object] = {"worker_id": worker.worker_id, "role": worker.role.value,
                                        "state": worker.state.value,
                                        "node_id": worker.node_id, "node_ip": worker.node_ip,  # None: pending
                                        "pid": worker.pid, "tensor_parallel_size": worker.tp,
                                        "tokens_on_the_way": self.books.in_flight(worker.worker_id)}
            if worker.next_role is not None:
                entry["next_role"] = worker.next_role.value
            if worker.emptying:  # draining or changing role: what it still waits for
                entry["emptying"] = worker.emptying
            if worker.state is WorkerState.PENDING:  # why it waits, and until when (an added one)
                available = available if available is not None else ray.available_resources()
                entry["pending_reason"] = pending_reason(worker, deployment.config, available)
            if worker.runtime is not None:  # dtype, GEMM kernel, threads, cores, KV bytes per token
                entry["runtime"] = dataclasses.asdict(worker.runtime)
            load = loads.get(worker.worker_id)
            if load is not None:
                entry |= {"requests": load.num_requests, "running_requests": load.num_running,
                          "waiting_requests": load.num_waiting,
                          "queued_prompt_tokens": load.num_queued_prompt_tokens,
                          "transferring": load.num_transferring, "free_kv_blocks": load.num_free_blocks,
                          "used_kv_blocks": load.num_total_blocks - load.num_free_blocks,
                          "total_kv_blocks": load.num_total_blocks,
                          # The most one request may hold here (the engine refuses more).
                          "total_kv_tokens": load.num_total_blocks * deployment.config.engine.block_size}
            workers.append(entry)
        change = self.resizer.current_plan
        answer: dict[str, object] = {
            **pools.active,
            "target": pools.target,
            "tensor_parallel": self._degrees(),
            "status": pools.status,
            "backend": deployment.backend.value,
            "torch_rendezvous": deployment.torch_rendezvous,  # the torch group's init address (torch backend)
            "pending": pools.num_pending,  # workers no node can take yet
            "change_in_progress": None if change is None else dataclasses.asdict(change),
            "auto": self.is_auto,
            "queued_prompt_tokens": controller.queued_prompt_tokens(),  # routed, not yet prefilled
            "ratio_decisions": [decision_summary(d) for d in list(controller.decisions)[-20:]],
            "workers": workers,
        }
        if self.scaler is not None:
            answer["scale"] = self.scaler.status()
        return answer

    async def steps(self, worker_id: str, since: float) -> list[dict[str, object]]:
        """GET /admin/workers/{id}/steps: the worker's forwards since `since` (KeyError: no such worker)."""
        worker = self.deployment.workers[worker_id]
        return [dataclasses.asdict(step) for step in await worker.client.step_timeline(since)]

    async def put_pools(self, layout: PoolLayout) -> dict[str, object]:
        """PUT /admin/pools: checked (ResizeRefused, ResizeConflict before anything moves), then applied one
        worker at a time; or the controller turned on or off."""
        resizer = self.resizer
        if layout.auto is not None:
            if layout.auto and not self.deployment.can_change:
                resizer.check(layout)  # the same 409 as any change on a fixed torch group
            if layout.auto:
                self.start_auto()
            else:
                await self.stop_auto()  # a change it was applying is rolled back first
            return {"auto": self.is_auto}
        moves = resizer.check(layout)  # ResizeRefused (400) / ResizeConflict (409) before anything moves
        await self.stop_auto()  # a layout set by hand stays until the operator turns auto back on
        result = await resizer.apply(moves, layout.drain_grace_s, layout.placement_wait_s,
                                     layout.role_tp(self.deployment.config))
        return {"layout": {role.value: n for role, n in layout.by_role().items()},
                "tensor_parallel": self._degrees(),
                **dataclasses.asdict(result), "moves": [m.describe() for m in result.moves]}

    def _degrees(self) -> dict[str, int]:
        """Role → the tensor-parallel degree its workers start at now."""
        return {role.value: self.deployment.config.tp_of(role) for role in Role}
