"""The ratio controller (`pdserve serve --ratio auto`, or `PUT /admin/pools {"auto": true}`): moves workers
between roles as the traffic changes, one worker at a time, along the ladder of layouts (its levels and
rules: gateway/ratio/ladder.py). This module owns the I/O loop around it:
    tick (every interval_s, or at once when a long prompt arrives) → Signals (from what the gateway
    already knows: prompt tokens queued on each worker and on their way, decode batch sizes, KV occupancy,
    recent TTFT and ITL against the SLOs) → Ladder.decide(); at 0 → 1 the worker holding the most prompt
    work becomes the prefill worker (its streams move to the others, losing no token).
    → with a profile (`--profile`, from `pdserve tune profile`), when no rule fires: every
      plan_interval_s the planner (gateway/ratio/planner.py) replays the last minute's arrivals through the
      tuner's simulator on every layout of the ladder; a layout predicted to serve it with at least
      plan_margin more goodput than the current one, named by plan_confirmations predictions in a row, is
      moved to ("plan"). The rules stay as guards: the planner never lowers the level while a long prompt is
      about. Each such decision keeps its prediction, and plan_check_s later what was measured.
    → moves applied through the PoolResizer (one change at a time, shared with PUT /admin/pools).
While it is on (and the operator set no queue rule of their own), the router also prefills a prompt shorter
than long_prompt_tokens on a decode worker when every prefill worker has long_prompt_tokens queued: a
prefill pool split off for long prompts must not make short ones wait behind them (at level 0 no prefill
worker exists, and the rule does nothing).
Hysteresis: up on a high mark, down only after calm_s below a low mark; and no change within min_dwell_s
of the last. Every decision is logged with its reason, counted in pdserve:ratio_changes_total{from,to,
reason}, and kept (the last 200) for GET /admin/pools.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field, replace

from gateway.fleet.deployment import PDDeployment
from gateway.fleet.workers import WorkerState
from gateway.ratio.books import RoutingBooks
from gateway.ratio.ladder import ControllerPolicy, Decision, Ladder, Signals
from gateway.ratio.loop_task import LoopTask
from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.resize import Move, PoolResizer, plan_moves
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import RecentTraffic
from tuner.simulator import Layout
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)


@dataclass
class RatioController:
    deployment: PDDeployment
    books: RoutingBooks  # the routers' counts (what is queued where, on its way)
    resizer: PoolResizer
    recent: RecentLatencies
    policy: ControllerPolicy = field(default_factory=ControllerPolicy)
    planner: LayoutPlanner | None = None  # with a profile: layouts predicted from the traffic
    traffic: RecentTraffic | None = None  # the planner's input: recent arrivals and their lengths
    decisions: collections.deque[Decision] = field(default_factory=lambda: collections.deque(maxlen=200))
    # Workers moved by (from role, to role, reason): pdserve:ratio_changes_total.
    changes: collections.Counter[tuple[str, str, str]] = field(default_factory=collections.Counter)

    def __post_init__(self) -> None:
        self._wake = asyncio.Event()
        self._loop = LoopTask()
        self.ladder = Ladder(self.policy)
        self._changed_at = float("-inf")  # time.monotonic() when the last change ended
        self._last_long_prompt = float("-inf")  # time.monotonic() of the latest long prompt
        self._last_plan = float("-inf")  # time.monotonic() of the planner's last prediction
        self._plan_streak: tuple[Layout | None, int] = (None, 0)  # the better layout named, how many times
        self._operator_local_prefill = self.books.local_prefill  # what the router had before auto
        self.books.on_local_prefill.append(self.note_prompt)  # a long prompt placed beside streams: look now

    @property
    def is_on(self) -> bool:
        return self._loop.is_on

    def start(self) -> None:
        if self._loop.start(self._run):
            self._operator_local_prefill = self.books.local_prefill
            self._set_local_prefill()

    async def stop(self) -> None:
        """Turn auto off. A change it is applying is cancelled and returns once the deployment has rolled the
        moving worker back to where it was (or marked it failed, to be replaced): nothing stays half moved."""
        if self.is_on:
            self.books.local_prefill = self._operator_local_prefill
        await self._loop.stop()

    def set_policy(self, policy: ControllerPolicy) -> None:
        self.policy = policy
        self.ladder = Ladder(policy)
        if self.is_on:
            self._set_local_prefill()

    def _set_local_prefill(self) -> None:
        """Short prompts are not left behind long ones in the prefill pool (see the module docstring),
        unless the operator chose a queue rule."""
        operator = self._operator_local_prefill
        if not operator.min_prefill_queue_tokens:
            long = self.policy.long_prompt_tokens
            self.books.local_prefill = replace(operator, min_prefill_queue_tokens=long,
                                                queue_rule_below_tokens=long)

    def note_prompt(self, num_uncached_tokens: int) -> None:
        """Called as each request arrives, and as a worker that decodes starts prefilling one for itself: a
        long prompt wakes the controller at once."""
        if num_uncached_tokens >= self.policy.long_prompt_tokens:
            self._last_long_prompt = time.monotonic()
            self._wake.set()

    async def _run(self) -> None:
        while True:
            # Woken early by a long prompt, or the interval passed. asyncio.timeout, not wait_for: Python
            # 3.11's wait_for drops a cancel (stop()) landing as a long prompt wakes it: the loop ran on.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.policy.interval_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.tick()
            except Exception:  # the controller must never die; the pools stay as they are
                logger.exception("ratio controller tick failed")

    async def tick(self) -> Decision | None:
        # A worker still PENDING (no node for it yet) may stay so for long; the controller moves only active
        # workers, so it does not wait for it.
        settled = (WorkerState.ACTIVE, WorkerState.PENDING)
        if self.resizer.is_busy or any(w.state not in settled for w in self.deployment.workers.values()):
            return None  # a change (ours or an operator's), a start or a replacement is under way
        signals = self.signals(await self.deployment.loads())
        self._check_planned_moves()
        decision = self.ladder.decide(signals, time.monotonic())
        if decision is None:
            decision = await self._plan(signals)
        if decision is not None:
            await self._apply(decision)
        return decision

    def layout_of(self, level: int, num_workers: int) -> Layout:
        """The ladder's layout at `level`: all mixed at 0, else level prefill + the rest decode."""
        return Layout(0, 0, num_workers) if level == 0 else Layout(level, num_workers - level, 0)

    async def _plan(self, s: Signals) -> Decision | None:
        """The planner's move, if its prediction calls for one (see the module docstring)."""
        now = time.monotonic()
        is_due = now - self._last_plan >= self.policy.plan_interval_s
        if self.planner is None or self.traffic is None or not is_due:
            return None
        self._last_plan = now
        prediction = await asyncio.to_thread(self.planner.predict, self.traffic.window())
        if prediction is None:
            return None
        current = prediction.of(self.layout_of(s.level, s.num_workers))
        best = prediction.scores[0]
        is_better = (current is not None and best.layout != current.layout
                     and best.goodput >= (1 + self.policy.plan_margin) * current.goodput
                     and best.goodput - current.goodput >= 0.01)
        if not is_better:
            self._plan_streak = (None, 0)
            return None
        named, count = self._plan_streak
        count = count + 1 if named == best.layout else 1
        self._plan_streak = (best.layout, count)
        to_level = best.layout.prefill
        if count < self.policy.plan_confirmations or not self.ladder.can_move(now):
            return None
        if to_level < s.level and self.ladder.is_long_prompt_about(s):
            return None  # the ladder's guard: long prompts need the prefill pool they have
        assert current is not None
        self._plan_streak = (None, 0)
        return Decision(time.time(), s.level, to_level, "plan",
                        f"predicted goodput {best.goodput:.2f} req/s on {best.layout.label()} against "
                        f"{current.goodput:.2f} on {current.layout.label()} for the last "
                        f"{prediction.num_requests} requests ({prediction.rate:.2f} req/s)", s,
                        prediction=prediction.summary())

    def _check_planned_moves(self) -> None:
        """plan_check_s after a planned move: log what was measured beside what was predicted."""
        now = time.time()
        for decision in self.decisions:
            is_due = now - decision.at >= self.policy.plan_check_s
            if decision.prediction is None or decision.measured or not is_due:
                continue
            since = time.monotonic() - (now - decision.at)
            slo = (self.policy.ttft_slo_s, self.policy.itl_slo_s)
            decision.measured.update({
                "ttft_p90_s": self.recent.ttft_quantile(0.9, since=since),
                "tpot_p90_s": self.recent.tpot_quantile(0.9, since=since),
                "attainment": self.recent.attainment(*slo, since=since)})
            layouts = decision.prediction.get("layouts", {})
            predicted = layouts.get(decision.prediction.get("best")) if isinstance(layouts, dict) else None
            logger.warning("ratio controller: planned move to level %d: predicted %s, measured %s",
                           decision.to_level, predicted, decision.measured)

    def signals(self, loads: list[WorkerLoad]) -> Signals:
        decoding = [x for x in loads if Role(x.role).can_decode]
        now = time.monotonic()
        return Signals(
            level=self.deployment.target[Role.PREFILL],
            num_workers=sum(self.deployment.target.values()),
            queued_prompt_tokens=self.queued_prompt_tokens(),
            num_decoding=sum(x.num_running for x in decoding),
            kv_occupancy=max((x.kv_occupancy for x in decoding), default=0.0),
            # Only requests that finished since the last change: the layout before it says nothing now.
            ttft_p90_s=self.recent.ttft_quantile(0.9, since=self._changed_at),
            tpot_p90_s=self.recent.tpot_quantile(0.9, since=self._changed_at),
            itl_p50_s=self.recent.itl_quantile(0.5, since=self._changed_at),
            longest_pending_prompt=self.books.longest_local_prefill(),
            longest_prompt_beside_streams=self.books.longest_prefill_beside_streams(),
            seconds_since_long_prompt=now - self._last_long_prompt,
        )

    def queued_prompt_tokens(self, worker_id: str | None = None) -> int:
        """Prompt tokens routed and not yet prefilled (the gateway's own count: it sees a prompt the moment
        it is routed, before any worker reports it), on one worker or on all."""
        counts = (self.books.prefill_tokens, self.books.local_prefill_tokens)
        if worker_id is not None:
            return sum(c.get(worker_id, 0) for c in counts)
        return sum(sum(c.values()) for c in counts)

    async def _apply(self, decision: Decision) -> None:
        n = decision.signals.num_workers
        target = ({Role.PREFILL: 0, Role.DECODE: 0, Role.MIXED: n} if decision.to_level == 0 else
                  {Role.PREFILL: decision.to_level, Role.DECODE: n - decision.to_level, Role.MIXED: 0})
        moves = self._with_chosen_workers(plan_moves(self.deployment.target, target))
        logger.warning("ratio controller: level %d → %d (%s: %s)", decision.from_level, decision.to_level,
                       decision.reason, decision.detail)
        self.ladder.note_change(time.monotonic(), decision)
        self.decisions.append(decision)
        result = await self.resizer.apply(moves, grace_s=self.policy.grace_s)
        for move in moves[:len(result.done)]:
            from_role = move.from_role.value if move.from_role else "none"
            self.changes[(from_role, move.role.value, decision.reason)] += 1
        self._changed_at = time.monotonic()
        self.ladder.note_change(self._changed_at)  # dwell from the end of the change, not its start
        if result.error:
            logger.error("ratio controller: the change stopped: %s", result.error)

    def _with_chosen_workers(self, moves: list[Move]) -> list[Move]:
        """Name the worker of every role change. A worker becoming prefill is the one with the most prompt
        work queued (a long prompt that arrived on a mixed worker is routed again to the same worker once
        it prefills, its computed blocks still in the prefix cache); the others go in the resizer's order
        (the least busy first)."""
        queued = {w: self.queued_prompt_tokens(w) for w in self.deployment.workers}
        held = {x.worker_id: x.num_requests for x in self.deployment.last_loads}
        taken: set[str] = set()

        def take(role: Role, key: dict[str, int], most: bool) -> str | None:
            candidates = [w.worker_id for w in self.deployment.active(role) if w.worker_id not in taken]
            if not candidates:
                return None
            chosen = (max if most else min)(candidates, key=lambda i: key.get(i, 0))
            taken.add(chosen)
            return chosen

        named: dict[int, str | None] = {}
        for i, move in enumerate(moves):  # prefill-bound changes choose first
            if move.action == "change" and move.role is Role.PREFILL and move.from_role is not None:
                named[i] = take(move.from_role, queued, most=True)
        for i, move in enumerate(moves):
            if move.action == "change" and i not in named and move.from_role is not None:
                named[i] = take(move.from_role, held, most=False)
        return [Move(m.action, m.role, m.from_role, named.get(i)) for i, m in enumerate(moves)]
