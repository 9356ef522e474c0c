"""The scale controller (`pdserve serve --scale auto --min-workers A --max-workers B --profile P`): the
fleet's size and split follow the traffic. This module owns the I/O loop around the Sizer
(gateway/ratio/sizing.py, the rules and their hysteresis):
    tick every interval_s → the recent arrivals (the gateway's RecentTraffic window) → plan_size() off the
    event loop (the tuner's simulator over every layout of every size in range) → corrected() by the SLO
    attainment measured since the last change → Sizer.decide()
    → the decision applied through the PoolResizer, as a PUT /admin/pools would be: workers added wait
      pending until Ray places them (where the cluster autoscales, --autoscale-wait-s: Ray's autoscaler
      adds a node for their demand); a worker that leaves is drained losslessly (its streams move) before
      its actor ends, so its node can go.
    → check_s later, the measured TTFT p90, TPOT p90 and SLO attainment logged beside the prediction.
It takes the ratio controller's place (a size is always chosen with its split); PUT /admin/pools
{"auto": false} stops it and a layout set by hand stays until {"auto": true}. Every decision is logged,
counted in pdserve:scale_changes_total{reason}, and kept (the last 200) for GET /admin/pools.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

from gateway.fleet.deployment import PDDeployment
from gateway.fleet.workers import WorkerState
from gateway.ratio.loop_task import LoopTask
from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import PoolResizer, ResizeConflict, ResizeRefused
from gateway.ratio.sizing import ScalePolicy, SizeDecision, Sizer, corrected, plan_size
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import RecentTraffic
from tuner.simulator import Layout
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class ScaleController:
    deployment: PDDeployment
    resizer: PoolResizer
    recent: RecentLatencies
    traffic: RecentTraffic
    planner: LayoutPlanner  # over every layout of every size in range
    policy: ScalePolicy
    ttft_slo_s: float
    itl_slo_s: float
    decisions: collections.deque[SizeDecision] = field(default_factory=lambda: collections.deque(maxlen=200))
    changes: collections.Counter[str] = field(default_factory=collections.Counter)  # by reason
    last_error: str = ""  # why the last change stopped part way (a worker no node took, ...)
    last_plan: dict[str, object] | None = None  # the latest plan, acted on or not (why it did not move)

    def __post_init__(self) -> None:
        self.sizer = Sizer(self.policy)
        self.traffic.window_s = self.policy.window_s  # the window each plan replays
        self._loop = LoopTask()
        self._changed_at = float("-inf")  # time.monotonic() when the last change ended

    @property
    def is_on(self) -> bool:
        return self._loop.is_on

    def start(self) -> None:
        self._loop.start(self._run)

    async def stop(self) -> None:
        """Turn it off; a change it is applying is cancelled and rolled back (nothing stays half moved)."""
        await self._loop.stop()

    def current_layout(self) -> Layout:
        target = self.deployment.target
        return Layout(target[Role.PREFILL], target[Role.DECODE], target[Role.MIXED])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.policy.interval_s)
            try:
                await self.tick()
            except Exception:  # the controller must never die; the pools stay as they are
                logger.exception("scale controller tick failed")

    async def tick(self) -> SizeDecision | None:
        self._check_outcomes()
        # A worker being started, replaced or moved: the fleet is not the layout it aims at yet.
        settled = (WorkerState.ACTIVE, WorkerState.PENDING)
        if self.resizer.is_busy or any(w.state not in settled for w in self.deployment.workers.values()):
            return None
        plan = await asyncio.to_thread(plan_size, self.planner, self.traffic.window(), self.policy)
        if plan is None:
            return None
        # Requests that arrived since the last change and did not move (the fleet before it, and the
        # change's own transients, say nothing of the fleet now), in the window.
        since = max(self._changed_at, time.monotonic() - self.policy.window_s)
        measured = self.recent.settled_attainment(self.ttft_slo_s, self.itl_slo_s, since,
                                                  self.policy.min_measured_requests)
        plan = corrected(plan, measured, self.current_layout(), self.policy)
        self.last_plan = {"at": time.time(), **plan.summary()}
        decision = self.sizer.decide(plan, self.current_layout(), time.monotonic())
        if decision is not None:
            await self._apply(decision)
        return decision

    async def _apply(self, decision: SizeDecision) -> None:
        to = decision.to_layout
        layout = PoolLayout(prefill=to.prefill, decode=to.decode, mixed=to.mixed)
        logger.warning("scale controller: %s → %s (%s: %s)", decision.from_layout.label(), to.label(),
                       decision.reason, decision.detail)
        self.decisions.append(decision)
        try:
            # The checks a PUT gets: no room without an autoscaler, a worker not active yet, ...
            moves = self.resizer.check(layout)
            result = await self.resizer.apply(moves, layout.drain_grace_s)
            self.last_error = result.error
        except (ResizeRefused, ResizeConflict) as error:  # nothing moved: the fleet stays as it is
            self.last_error = str(error)
        finally:
            self._changed_at = time.monotonic()
            self.sizer.note_change(self._changed_at)
        if self.last_error:
            decision.measured["error"] = self.last_error
            logger.error("scale controller: the change stopped: %s", self.last_error)
        else:
            self.changes[decision.reason] += 1

    def _check_outcomes(self) -> None:
        """check_s after a change: what was measured since, beside what was predicted."""
        now = time.time()
        slo = (self.ttft_slo_s, self.itl_slo_s)
        for decision in self.decisions:
            if "attainment" in decision.measured or now - decision.at < self.policy.check_s:
                continue
            since = time.monotonic() - (now - decision.at)
            decision.measured.update({
                "ttft_p90_s": self.recent.ttft_quantile(0.9, since=since),
                "tpot_p90_s": self.recent.tpot_quantile(0.9, since=since),
                "attainment": self.recent.attainment(*slo, since=since)})
            sizes = decision.prediction.get("sizes", {})
            predicted = sizes.get(str(decision.to_layout.num_workers)) if isinstance(sizes, dict) else None
            logger.warning("scale controller: %s to %s: predicted %s, measured %s", decision.reason,
                           decision.to_layout.label(), predicted, decision.measured)

    def status(self) -> dict[str, object]:
        """GET /admin/pools' "scale": the range, whether it is on, the last decisions."""
        return {"on": self.is_on, "min_workers": self.policy.min_workers,
                "max_workers": self.policy.max_workers, "roles": self.policy.roles.summary(),
                "last_error": self.last_error,
                "last_plan": self.last_plan,
                "decisions": [d.summary() for d in list(self.decisions)[-20:]]}
