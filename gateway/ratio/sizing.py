"""The fleet's size from its traffic (`pdserve serve --scale auto`), apart from any I/O (tested without a
fleet): how many workers, and in which roles, the recent traffic needs.

    plan_size(planner, arrivals, policy) → SizePlan: the window's arrivals, squeezed to (1 + headroom)× their
      rate (the margin), replayed through the tuner's simulator on every layout of every size from
      min_workers to max_workers that the per-role bounds allow (RoleBounds) → the smallest size whose best
      layout keeps SLO attainment at or above target_attainment; none does: the largest, at its best layout.
    Sizer.decide(plan, current layout, now) → SizeDecision or None, with hysteresis:
      out        a larger size named by out_confirmations plans in a row: straight to it (a burst needs
                 every worker it needs at once; each waits pending for a node where the cluster autoscales)
      in         a smaller size named by every plan for in_calm_s: one worker fewer (drained losslessly),
                 and in_calm_s again before the next (a burst that ends does not empty the fleet at once)
      rebalance  the same size, a better split of it by plan_margin of goodput, out_confirmations in a row
      and no change within min_dwell_s of the last one's end. What was measured overrules the prediction
      upward (corrected()): SLO attainment below target on the current fleet while the plan names no larger
      one is one worker more (the prediction is not borne out), and no worker fewer.
The controller around it (gateway/ratio/scaler.py) applies each decision through the PoolResizer and logs
the measured outcome beside the prediction.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gateway.ratio.planner import LayoutPlanner, rank
from gateway.ratio.role_bounds import RoleBounds
from gateway.telemetry.traffic import Arrival
from tuner.metrics import HOLD_ATTAINMENT, LayoutScore
from tuner.simulator import Layout


@dataclass(frozen=True)
class ScalePolicy:
    min_workers: int
    max_workers: int
    roles: RoleBounds = field(default_factory=RoleBounds)  # how many workers may serve each role
    interval_s: float = 10.0  # how often it plans
    headroom: float = 0.2  # the window replayed at (1 + headroom)× its rate: the size must hold more
    target_attainment: float = HOLD_ATTAINMENT  # a size holds the traffic at this SLO attainment
    out_confirmations: int = 2  # plans in a row naming a larger size (or a better split)
    in_calm_s: float = 60.0  # a smaller size named this long before one worker leaves
    min_dwell_s: float = 20.0  # no change sooner than this after the last one ended
    plan_margin: float = 0.1  # a rebalance's predicted goodput gain
    check_s: float = 30.0  # after a change, when the measured outcome is logged beside the prediction
    window_s: float = 60.0  # the recent traffic each plan replays
    # Fewer arrivals in the window than this (but some): no plan. 1: a trickle is planned too (on its few
    # requests the smallest size holds), so that a fleet left large by a burst shrinks under light traffic.
    min_requests: int = 1
    # A measured SLO attainment overrules the plan only over this many requests that arrived after the last
    # change and did not move (the change's own transients are not the fleet's: review P8).
    min_measured_requests: int = 20
    # A measurement-driven scale-out that would undo the last scale-in waits this many dwells; each such
    # reversal doubles the calm period before the next scale-in.
    reversal_dwells: int = 3

    def __post_init__(self) -> None:
        if self.min_workers < 1:
            raise ValueError(f"--min-workers must be >= 1, got {self.min_workers}")
        if self.min_workers > self.max_workers:
            raise ValueError(f"--min-workers {self.min_workers} is above --max-workers {self.max_workers}")
        if min(self.interval_s, self.in_calm_s) <= 0 or self.headroom < 0 or self.min_dwell_s < 0:
            raise ValueError(f"scale intervals must be > 0 and the headroom >= 0, got {self}")
        if not 0 < self.target_attainment <= 1:
            raise ValueError(f"target_attainment must be in (0, 1], got {self.target_attainment}")
        if not self.sizes:
            raise ValueError(f"{self.roles.describe()}: no layout of --min-workers {self.min_workers} .. "
                             f"--max-workers {self.max_workers} workers (all mixed, or some prefill and the "
                             "rest decode; a mixed worker counts for both roles) keeps within them")

    def layouts_of(self, num_workers: int) -> list[Layout]:
        """The layouts of that size the per-role bounds allow, all mixed first where allowed."""
        return [layout for layout in layouts_of(num_workers) if self.roles.allows(layout)]

    @property
    def sizes(self) -> list[int]:
        """The sizes from min_workers to max_workers with a layout the per-role bounds allow."""
        return [n for n in range(self.min_workers, self.max_workers + 1) if self.layouts_of(n)]

    @property
    def candidates(self) -> list[Layout]:
        """Every layout the scale controller may move to."""
        return [layout for n in self.sizes for layout in self.layouts_of(n)]


def layouts_of(num_workers: int) -> list[Layout]:
    """The layouts of one size the controllers move between: all mixed, or k prefill + the rest decode."""
    return [Layout(0, 0, num_workers)] + [Layout(k, num_workers - k, 0) for k in range(1, num_workers)]


def candidate_layouts(sizes: Iterable[int]) -> list[Layout]:
    return [layout for n in sizes for layout in layouts_of(n)]


@dataclass(frozen=True)
class SizePlan:
    """One plan: the size the window's traffic needs, and each size's best layout."""

    size: int  # the smallest that holds it (the largest when none does)
    layout: Layout  # that size's best layout
    holds: bool  # False: no size in range holds the traffic with the headroom
    rate: float  # requests/s over the window, as it arrived
    num_requests: int
    best_by_size: dict[int, LayoutScore]
    scores: tuple[LayoutScore, ...]  # every candidate's, best first
    # The SLO attainment measured since the last change, where it overrode the prediction (below target
    # while the plan named no larger size: the profile is optimistic here, one more worker).
    measured_attainment: float | None = None

    def score_of(self, layout: Layout) -> LayoutScore | None:
        return next((s for s in self.scores if s.layout == layout), None)

    def summary(self) -> dict[str, object]:
        """What the decision log keeps: each size's best layout and its predicted figures."""
        return {"requests": self.num_requests, "rate": round(self.rate, 3), "size": self.size,
                "best": self.layout.label(), "holds": self.holds,
                "measured_attainment": self.measured_attainment,
                "sizes": {str(n): {"layout": s.layout.label(), "attainment": round(float(s.attainment), 3),
                                   "goodput": round(float(s.goodput), 3),
                                   "ttft_p90_s": round(float(s.ttft_p90_s), 3),
                                   "itl_p99_s": round(float(s.itl_p99_s), 3)}
                          for n, s in sorted(self.best_by_size.items())}}


def squeezed(arrivals: list[Arrival], factor: float) -> list[Arrival]:
    """The same requests arriving `factor`× as fast (their gaps divided by it)."""
    if not arrivals or factor == 1.0:
        return arrivals
    start = arrivals[0].at
    return [Arrival(start + (a.at - start) / factor, a.prompt_tokens, a.output_tokens) for a in arrivals]


def plan_size(planner: LayoutPlanner, arrivals: list[Arrival], policy: ScalePolicy) -> SizePlan | None:
    """The size the traffic needs (see the module docstring); None with too few arrivals to say (the
    planner's min_requests), but the smallest size, all mixed, when none arrived at all."""
    if not arrivals:  # nothing arrived in the window: the smallest size, all mixed where allowed, holds it
        smallest = policy.sizes[0]
        return SizePlan(smallest, policy.layouts_of(smallest)[0], True, 0.0, 0, {}, ())
    prediction = planner.predict(squeezed(arrivals, 1.0 + policy.headroom))
    if prediction is None:
        return None
    best_by_size: dict[int, LayoutScore] = {}
    for scored in prediction.scores:  # best first: the first of each size is its best
        best_by_size.setdefault(scored.layout.num_workers, scored)
    holding = [n for n in sorted(best_by_size) if best_by_size[n].attainment >= policy.target_attainment]
    if holding:
        size, holds = holding[0], True
    else:  # none holds: the size that serves it best (the largest, unless a larger one does no better)
        size, holds = max(best_by_size, key=lambda n: (rank(best_by_size[n]), n)), False
    rate = prediction.rate / (1.0 + policy.headroom)
    return SizePlan(size, best_by_size[size].layout, holds, rate, prediction.num_requests, best_by_size,
                    prediction.scores)


def corrected(plan: SizePlan, measured_attainment: float | None, current: Layout, policy: ScalePolicy
              ) -> SizePlan:
    """The plan, overruled by what was measured: SLO attainment below target on the current fleet while the
    plan names no larger one means the prediction is not borne out (a profile taken apart from the gateway
    misses its share of each token's time): the next size up (one worker more where the per-role bounds allow
    it), up to max_workers, and no fewer meanwhile."""
    n = current.num_workers
    if measured_attainment is None or measured_attainment >= policy.target_attainment or plan.size > n:
        return plan
    size = next((s for s in policy.sizes if s > n), n)  # none larger: stays, and no fewer either
    best = plan.best_by_size.get(size)
    layout = best.layout if best is not None else (policy.layouts_of(size) or [current])[0]
    return replace(plan, size=size, layout=layout, holds=False, measured_attainment=measured_attainment)


@dataclass
class SizeDecision:
    at: float  # time.time()
    from_layout: Layout
    to_layout: Layout
    # "scale_out", "scale_in", "rebalance", or "scale_out_reversal" (a measured one undoing a scale-in)
    reason: str
    detail: str
    prediction: dict[str, object]
    measured: dict[str, object] = field(default_factory=dict)  # check_s after the change

    def summary(self) -> dict[str, object]:
        return {"at": self.at, "from": self.from_layout.label(), "to": self.to_layout.label(),
                "reason": self.reason, "detail": self.detail, "prediction": self.prediction,
                "measured": self.measured or None}


class Sizer:
    """The scale decisions, apart from any I/O: a plan, the current layout and the time in, a decision (or
    None) out; it keeps the hysteresis state."""

    def __init__(self, policy: ScalePolicy) -> None:
        self.policy = policy
        self._last_change = float("-inf")
        self._streak: tuple[object, int] = (None, 0)  # what the last plans named (larger size, better split)
        self._smaller_since: float | None = None  # every plan since named a smaller size
        self._last_reason = ""  # of the last decision made
        self.calm_factor = 1.0  # in_calm_s ×: doubled by each reversal of a scale-in

    def note_change(self, now: float) -> None:
        """A change ended at `now`: the dwell and the calm timer start again."""
        self._last_change = now
        self._streak = (None, 0)
        self._smaller_since = None

    @property
    def in_calm_s(self) -> float:
        return self.policy.in_calm_s * self.calm_factor

    def decide(self, plan: SizePlan, current: Layout, now: float) -> SizeDecision | None:
        p = self.policy
        n = current.num_workers
        if plan.size >= n:
            self._smaller_since = None
        elif self._smaller_since is None:
            self._smaller_since = now
        named: object = None
        if plan.size > n:
            named = ("out", plan.size)  # its best split may change from plan to plan: the size counts
        elif plan.size == n and self._is_better_split(plan, current):
            named = ("split", plan.layout)
        last, count = self._streak
        self._streak = (named, count + 1 if named is not None and named == last else int(named is not None))
        if now - self._last_change < p.min_dwell_s:
            return None
        if self._streak[1] >= p.out_confirmations:
            if plan.size > n and plan.measured_attainment is not None:
                if self._last_reason == "scale_in":  # it would undo the last scale-in: a flap?
                    if now - self._last_change < p.reversal_dwells * p.min_dwell_s:
                        return None
                    self.calm_factor *= 2  # the next scale-in waits longer
                    return self._decision(plan, current, plan.layout, "scale_out_reversal",
                                          f"measured SLO attainment {plan.measured_attainment:.0%} on "
                                          f"{current.label()} since the last scale-in is below "
                                          f"{p.target_attainment:.0%}: it is undone, to "
                                          f"{plan.layout.label()}; the next scale-in waits "
                                          f"{self.in_calm_s:.0f} s of calm")
                return self._decision(plan, current, plan.layout, "scale_out",
                                      f"measured SLO attainment {plan.measured_attainment:.0%} on "
                                      f"{current.label()} is below {p.target_attainment:.0%} (predicted "
                                      f"{self._attainment(plan, n)}): one worker more, to "
                                      f"{plan.layout.label()}")
            if plan.size > n:
                why = ("holds" if plan.holds else "serves best (none in range holds)")
                return self._decision(plan, current, plan.layout, "scale_out",
                                      f"{plan.layout.label()} {why} {plan.num_requests} requests at "
                                      f"{plan.rate:.2f} req/s with {p.headroom:.0%} headroom; "
                                      f"{current.label()} is predicted at {self._attainment(plan, n)}")
            best, now_score = plan.best_by_size.get(n), plan.score_of(current)
            predicted = f"predicted {best.goodput:.2f} req/s of goodput" if best else "holds the traffic"
            against = (f"against {now_score.goodput:.2f} on {current.label()}" if now_score is not None else
                       f"; {current.label()} is outside {p.roles.describe()}")
            return self._decision(plan, current, plan.layout, "rebalance",
                                  f"{plan.layout.label()} {predicted} {against}")
        smaller_sizes = [s for s in p.sizes if s < n]
        if self._smaller_since is not None and now - self._smaller_since >= self.in_calm_s and smaller_sizes:
            size = smaller_sizes[-1]  # n - 1 unless the per-role bounds allow no layout of that size
            smaller = plan.best_by_size.get(size)  # none when nothing arrived: all mixed serves best then
            to = smaller.layout if smaller is not None else p.layouts_of(size)[0]
            fewer = ("one worker fewer" if size == n - 1 else
                     f"{n - size} workers fewer ({p.roles.describe()})")
            return self._decision(plan, current, to, "scale_in",
                                  f"{plan.size} worker(s) ({plan.layout.label()}) predicted to hold the "
                                  f"traffic ({plan.rate:.2f} req/s, {p.headroom:.0%} headroom) for "
                                  f"{self.in_calm_s:.0f} s: {fewer}, to {to.label()}")
        return None

    def _is_better_split(self, plan: SizePlan, current: Layout) -> bool:
        """The plan's best layout of the current size beats the current split by the margin of goodput, or
        the current split is outside the per-role bounds (set by hand while the controller was off)."""
        if not self.policy.roles.allows(current):
            return plan.layout != current
        best, now = plan.best_by_size.get(current.num_workers), plan.score_of(current)
        if best is None or now is None or best.layout == current:
            return False
        gain = best.goodput - now.goodput
        return best.goodput >= (1 + self.policy.plan_margin) * now.goodput and gain >= 0.01

    @staticmethod
    def _attainment(plan: SizePlan, size: int) -> str:
        score = plan.best_by_size.get(size)
        return "no figure" if score is None else f"{score.attainment:.0%} SLO attainment at best"

    def _decision(self, plan: SizePlan, current: Layout, to: Layout, reason: str, detail: str
                  ) -> SizeDecision:
        self._last_reason = reason
        return SizeDecision(time.time(), current, to, reason, detail, plan.summary())
