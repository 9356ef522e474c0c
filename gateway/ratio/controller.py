"""The ratio controller (`pdserve serve --ratio auto`, or `PUT /admin/pools {"auto": true}`): moves workers
between roles as the traffic changes, one worker at a time.

It keeps the deployment on a ladder of layouts over its N workers: level 0 is N mixed workers (each
prefills and decodes its own requests: no transfer, every core decodes), level k ≥ 1 is k prefill + N-k
decode workers (running streams are protected from long prompts).
    tick (every interval_s, or at once when a long prompt arrives) → Signals (from what the gateway
    already knows: prompt tokens queued on each worker and on their way, decode batch sizes, KV occupancy,
    recent TTFT and ITL against the SLOs) → decide():
      0 → 1   a long prompt (≥ long_prompt_tokens) is being prefilled by a worker that also decodes other
              streams (one that prefills it with nothing else to decode stalls no one: light traffic keeps
              both workers prefilling long prompts, which halves their wait), or
              the requests' TPOT p90 is over the ITL SLO while prompts queue and the median gap is not
              (prefill chunks cause the tail; a slow median means decoding itself is short of cores,
              which disaggregation would make worse).
              The worker holding the most prompt work becomes the prefill worker (its streams move to the
              others, losing no token).
      k → k+1 TTFT p90 over its SLO with prompt work piling up on every prefill worker (≥ 1 decode stays).
      k → k-1 prefill has been idle (little queued, no long prompt) for calm_s; at k = 1 that means the
              prompts that needed protection are gone, and N mixed workers serve light traffic faster.
      1 → 0   calm_s after a move for the ITL SLO the requests' TPOT is no better: back, and that rule
              stays off for a while (decoding was short of cores, not troubled by prefill).
    → with a profile (`--profile`, from `pdserve tune profile`), when no rule above fires: every
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
from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.resize import Move, PoolResizer, plan_moves
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import RecentTraffic
from loadgen.summary import DEFAULT_ITL_SLO_S, DEFAULT_TTFT_SLO_S
from tuner.simulator import Layout
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)

NO_GAIN = 0.1  # a move for the ITL SLO must cut the requests' TPOT p90 by this fraction to stay
ITL_RULE_BACKOFF = 10  # calm periods the ITL rule stays off after a move that did not help


@dataclass(frozen=True)
class ControllerPolicy:
    interval_s: float = 1.0  # how often it looks (a long prompt wakes it at once)
    min_dwell_s: float = 2.0  # no change sooner than this after the last one (calm_s guards the way back)
    calm_s: float = 10.0  # prefill idle this long before a prefill worker goes back
    long_prompt_tokens: int = 1024  # a prompt this long interferes with decoding on a mixed worker
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S  # the SLOs every command shares (loadgen/summary.py)
    itl_slo_s: float = DEFAULT_ITL_SLO_S
    grace_s: float = 0.0  # a worker changing role hands its decode streams over at once
    plan_interval_s: float = 10.0  # how often the planner looks (with a profile)
    plan_margin: float = 0.1  # predicted goodput gain over the current layout that a move needs
    plan_confirmations: int = 2  # predictions in a row naming the same better layout
    plan_check_s: float = 30.0  # after a planned move, when the measured outcome is logged beside it

    def __post_init__(self) -> None:
        if min(self.interval_s, self.calm_s, self.ttft_slo_s, self.itl_slo_s) <= 0 or self.min_dwell_s < 0:
            raise ValueError(f"controller intervals and SLOs must be > 0, got {self}")
        if self.long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be >= 1, got {self.long_prompt_tokens}")


@dataclass(frozen=True)
class Signals:
    """What one tick saw."""

    level: int  # prefill workers aimed at (0: all mixed)
    num_workers: int
    queued_prompt_tokens: int  # routed to any worker and not yet prefilled
    num_decoding: int  # requests running on decode and mixed workers
    kv_occupancy: float  # the fullest decode or mixed worker
    ttft_p90_s: float | None  # over the recent window; None without enough requests
    tpot_p90_s: float | None  # over requests: each one's mean gap between tokens (goodput's ITL check)
    itl_p50_s: float | None  # over tokens
    longest_pending_prompt: int  # tokens of the longest prompt a decode or mixed worker is prefilling now
    longest_prompt_beside_streams: int  # ... on a worker that decodes other requests meanwhile
    seconds_since_long_prompt: float  # since one arrived (before it is routed, it is pending nowhere yet)


@dataclass(frozen=True)
class Decision:
    at: float  # time.time()
    from_level: int
    to_level: int
    reason: str  # "long_prompt", "itl_slo", "ttft_slo", "prefill_idle", "no_gain" or "plan"
    detail: str
    signals: Signals
    prediction: dict[str, object] | None = None  # the planner's, for "plan"
    measured: dict[str, object] = field(default_factory=dict)  # plan_check_s after a planned move


class Ladder:
    """The controller's decisions, apart from any I/O: signals and the time in, a Decision (or None) out;
    it keeps the hysteresis state (when the last change happened, since when prefill has been calm)."""

    def __init__(self, policy: ControllerPolicy) -> None:
        self.policy = policy
        self._last_change = float("-inf")
        self._calm_since: float | None = None
        # After a move for the ITL SLO: the TPOT p90 that caused it, until the new layout has been judged.
        self._tpot_before_itl_move: float | None = None
        self._itl_rule_off_until = float("-inf")  # a move for the ITL SLO that did not help is not retried

    def can_move(self, now: float) -> bool:
        return now - self._last_change >= self.policy.min_dwell_s

    def is_long_prompt_about(self, s: Signals) -> bool:
        """A long prompt is pending on a worker that decodes, or arrived within calm_s."""
        return (s.longest_pending_prompt >= self.policy.long_prompt_tokens
                or s.seconds_since_long_prompt < self.policy.calm_s)

    def note_change(self, now: float, decision: Decision | None = None) -> None:
        """A change was made (with the decision that made it) or ended at `now`: the dwell time and the calm
        timer start again."""
        self._last_change = now
        self._calm_since = None
        if decision is not None:
            self._tpot_before_itl_move = decision.signals.tpot_p90_s if decision.reason == "itl_slo" else None

    def decide(self, s: Signals, now: float) -> Decision | None:
        """The move the signals call for, if any (pure: no side effect but the calm timer)."""
        p = self.policy
        # Prefill is not calm while a long prompt arrives or a worker that decodes is prefilling one.
        is_long_prompt_here = (s.longest_pending_prompt >= p.long_prompt_tokens
                               or s.seconds_since_long_prompt < max(p.interval_s, 1.0))
        is_calm = s.queued_prompt_tokens < p.long_prompt_tokens // 4 and not is_long_prompt_here
        self._calm_since = (self._calm_since or now) if is_calm else None
        if now - self._last_change < p.min_dwell_s:
            return None
        level, n = s.level, s.num_workers
        if level == 0 and n >= 2:
            if s.longest_prompt_beside_streams >= p.long_prompt_tokens:
                return self._decision(s, 1, "long_prompt", f"a prompt of {s.longest_prompt_beside_streams} "
                                      f"tokens is being prefilled beside decoding streams ({s.num_decoding} "
                                      "decode)")
            # Only a tail that prefill chunks cause: with the median over the SLO too, decoding itself is
            # the bottleneck, and giving a decoding core to prefill would make it worse.
            is_tail = (s.tpot_p90_s is not None and s.itl_p50_s is not None and s.tpot_p90_s > p.itl_slo_s
                       and s.itl_p50_s <= p.itl_slo_s)
            if is_tail and s.queued_prompt_tokens and now >= self._itl_rule_off_until:
                assert s.tpot_p90_s is not None and s.itl_p50_s is not None
                return self._decision(s, 1, "itl_slo", f"TPOT p90 {s.tpot_p90_s * 1000:.0f} ms > SLO "
                                      f"{p.itl_slo_s * 1000:.0f} ms (median ITL {s.itl_p50_s * 1000:.0f} ms) "
                                      f"with {s.queued_prompt_tokens} prompt tokens queued")
            return None
        judged = self._judge_itl_move(s, now)
        if judged is not None:
            return judged
        if level >= 1 and level + 1 < n and s.ttft_p90_s is not None and s.ttft_p90_s > p.ttft_slo_s \
                and s.queued_prompt_tokens >= level * p.long_prompt_tokens:
            return self._decision(s, level + 1, "ttft_slo", f"TTFT p90 {s.ttft_p90_s:.2f} s > SLO "
                                  f"{p.ttft_slo_s:.2f} s with {s.queued_prompt_tokens} prompt tokens queued")
        if level >= 1 and self._calm_since is not None and now - self._calm_since >= p.calm_s:
            return self._decision(s, level - 1, "prefill_idle", f"under {p.long_prompt_tokens // 4} prompt "
                                  f"tokens queued and no long prompt for {p.calm_s:.0f} s")
        return None

    def _judge_itl_move(self, s: Signals, now: float) -> Decision | None:
        """calm_s after a move for the ITL SLO, did the requests' TPOT get better? If not by a tenth, the
        move cost a decoding core for nothing (decoding itself, not prefill interference, was short): go
        back, and leave the ITL rule off for ITL_RULE_BACKOFF calm periods."""
        before = self._tpot_before_itl_move
        if before is None or s.level != 1 or s.tpot_p90_s is None:
            return None
        if now - self._last_change < self.policy.calm_s:
            return None
        self._tpot_before_itl_move = None  # judged, whatever the verdict
        if s.tpot_p90_s < (1.0 - NO_GAIN) * before:
            return None
        self._itl_rule_off_until = now + ITL_RULE_BACKOFF * self.policy.calm_s
        return self._decision(s, 0, "no_gain", f"TPOT p90 {s.tpot_p90_s * 1000:.0f} ms after disaggregating, "
                              f"{before * 1000:.0f} ms before: no better")

    @staticmethod
    def _decision(s: Signals, to_level: int, reason: str, detail: str) -> Decision:
        return Decision(time.time(), s.level, to_level, reason, detail, s)



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
        self._task: asyncio.Task[None] | None = None
        self.ladder = Ladder(self.policy)
        self._changed_at = float("-inf")  # time.monotonic() when the last change ended
        self._last_long_prompt = float("-inf")  # time.monotonic() of the latest long prompt
        self._last_plan = float("-inf")  # time.monotonic() of the planner's last prediction
        self._plan_streak: tuple[Layout | None, int] = (None, 0)  # the better layout named, how many times
        self._operator_local_prefill = self.books.local_prefill  # what the router had before auto
        self.books.on_local_prefill.append(self.note_prompt)  # a long prompt placed beside streams: look now

    @property
    def is_on(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        if not self.is_on:
            self._task = asyncio.create_task(self._run())
            self._operator_local_prefill = self.books.local_prefill
            self._set_local_prefill()

    async def stop(self) -> None:
        """Turn auto off. A change it is applying is cancelled and returns once the deployment has rolled the
        moving worker back to where it was (or marked it failed, to be replaced): nothing stays half moved."""
        task, self._task = self._task, None
        if task is None:
            return
        self.books.local_prefill = self._operator_local_prefill
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

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
            with contextlib.suppress(TimeoutError):  # woken early by a long prompt, or the interval passed
                await asyncio.wait_for(self._wake.wait(), self.policy.interval_s)
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
