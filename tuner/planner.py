"""`pdserve tune plan`: simulate every layout of N workers at every rate, and pick one.

    Workload (a trace's lengths, or fixed lengths; Poisson arrivals at each rate, or the trace's times)
    → for each rate, for each layout x prefill + y decode + z mixed = N that can serve: simulate, score
    → per rate the best layout (most goodput; then attainment; then lower TTFT p90)
    → per layout the highest rate it holds (SLO attainment >= 90%) among the rates tried
    → recommended: with a target rate, the fewest workers (1..N) that hold it, best split of that size;
      otherwise the layout that holds the highest rate (ties: more goodput there).
The requests are exactly those `pdserve bench` sends for the same arguments (loadgen.workload.plan_requests),
so `tune validate` measures the load the plan predicted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from loadgen.summary import SLO
from loadgen.workload import RequestShape, TraceRow, plan_requests
from tuner.metrics import LayoutScore, score
from tuner.profile import Profile
from tuner.simulator import Layout, SimConfig, simulate


@dataclass(frozen=True)
class Workload:
    """What to send: the arguments of loadgen's plan_requests except the rate (validate reuses them)."""

    num_requests: int
    seed: int = 0
    burstiness: float = 1.0
    trace: tuple[TraceRow, ...] | None = None
    trace_path: str | None = None  # where the trace came from (for validate and the report)
    speed: float = 1.0
    input_len: int | None = None
    output_len: int | None = None
    length_scale: float = 1.0

    def requests(self, rate: float | None) -> list[RequestShape]:
        return plan_requests(self.num_requests, self.seed, rate, self.burstiness,
                             list(self.trace) if self.trace else None, self.speed, self.input_len,
                             self.output_len, self.length_scale)

    def describe(self) -> str:
        lengths = (f"trace {self.trace_path} (lengths ×{self.length_scale:g})" if self.trace
                   else f"{self.input_len} prompt / {self.output_len} output tokens")
        return f"{self.num_requests} requests, {lengths}"

    def to_dict(self) -> dict[str, object]:
        return {"num_requests": self.num_requests, "seed": self.seed, "burstiness": self.burstiness,
                "trace": self.trace_path, "speed": self.speed, "input_len": self.input_len,
                "output_len": self.output_len, "length_scale": self.length_scale}


def layouts_of(num_workers: int) -> list[Layout]:
    """The distinct layouts of exactly `num_workers` workers, most prefill first.

    Left out, because the router makes them another layout or a waste: decode workers beside mixed ones with
    no prefill pool prefill their own prompts (the same as all mixed), and prefill workers beside no decode
    worker get no prompt (requests go to a prefill worker only for a decode worker).
    """
    found = []
    for prefill in range(num_workers, -1, -1):
        for decode in range(num_workers - prefill, -1, -1):
            layout = Layout(prefill, decode, num_workers - prefill - decode)
            is_distinct = (prefill >= 1 and decode >= 1) or layout.mixed == num_workers
            if layout.can_serve and is_distinct:
                found.append(layout)
    return found


def _rank(s: LayoutScore) -> tuple[float, float, float]:
    return (s.goodput, s.attainment, -s.ttft_p90_s if s.ttft_p90_s == s.ttft_p90_s else float("-inf"))


@dataclass
class Plan:
    """The planner's answer; to_dict() is plan.json."""

    workload: Workload
    slo: SLO
    rates: tuple[float | None, ...]
    num_workers: int
    scores: list[LayoutScore]  # every layout of num_workers at every rate
    best_by_rate: dict[float | None, LayoutScore]
    max_rate_held: dict[Layout, float | None]  # None: holds none of the rates
    recommended: Layout
    reason: str
    target_rate: float | None = None
    target: LayoutScore | None = None  # the fewest workers holding target_rate (None: not even N)
    target_tried: list[LayoutScore] = field(default_factory=list)  # layouts of fewer workers tried for it
    seconds: float = 0.0  # wall time of the planning

    def to_dict(self, profile: Profile) -> dict[str, object]:
        return {
            "recommended": self.recommended.to_dict(),
            "reason": self.reason,
            "model": profile.model,
            "vocab_size": profile.vocab_size,
            "profile": {"hardware": profile.hardware, "device": profile.device, "dtype": profile.dtype,
                        "created": profile.created, "transfer_method": profile.transfer_method},
            "workload": self.workload.to_dict(),
            "slo": {"ttft_s": self.slo.ttft_s, "itl_s": self.slo.itl_s},
            "rates": list(self.rates),
            "num_workers": self.num_workers,
            "best_by_rate": [{"rate": rate, "layout": s.layout.to_dict(), "label": s.layout.label(),
                              "goodput": s.goodput} for rate, s in self.best_by_rate.items()],
            "max_rate_held": [{"layout": layout.to_dict(), "label": layout.label(), "rate": rate}
                              for layout, rate in self.max_rate_held.items()],
            "target_rate": self.target_rate,
            "target": None if self.target is None else self.target.to_dict(),
            "table": [s.to_dict() for s in self.scores],
            "seconds": self.seconds,
        }


def make_plan(profile: Profile, config: SimConfig, workload: Workload, rates: tuple[float | None, ...],
              slo: SLO, num_workers: int, target_rate: float | None = None,
              advance: Callable[[], None] = lambda: None) -> Plan:
    """Simulate and choose (see the module docstring); `advance` is called after each simulation."""
    if num_workers < 1:
        raise ValueError(f"--workers must be >= 1, got {num_workers}")
    if slo.ttft_s <= 0 or slo.itl_s <= 0:
        raise ValueError(f"SLOs must be > 0, got TTFT {slo.ttft_s} s and ITL {slo.itl_s} s")
    started = time.perf_counter()
    layouts = layouts_of(num_workers)
    scores = []
    for rate in rates:
        requests = workload.requests(rate)
        for layout in layouts:
            scores.append(score(simulate(layout, requests, config, profile.fits), slo, rate))
            advance()
    best_by_rate = {rate: max((s for s in scores if s.rate == rate), key=_rank) for rate in rates}
    max_rate_held: dict[Layout, float | None] = {}
    for layout in layouts:
        held = [s.rate for s in scores if s.layout == layout and s.holds]
        # The trace's own times (rate None) rank below any explicit rate.
        max_rate_held[layout] = max(held, key=lambda r: -1.0 if r is None else r) if held else None
    plan = Plan(workload, slo, rates, num_workers, scores, best_by_rate, max_rate_held, layouts[0], "",
                target_rate)
    if target_rate is not None:
        _plan_for_target(plan, profile, config, target_rate, advance)
    else:
        _recommend(plan)
    plan.seconds = time.perf_counter() - started
    return plan


def _recommend(plan: Plan) -> None:
    def strength(layout: Layout) -> tuple[float, float]:
        rate = plan.max_rate_held[layout]
        at_rate = [s for s in plan.scores if s.layout == layout and s.rate == rate]
        return (-2.0 if rate is None and not at_rate else -1.0 if rate is None else rate,
                at_rate[0].goodput if at_rate else 0.0)

    plan.recommended = max(plan.max_rate_held, key=strength)
    rate = plan.max_rate_held[plan.recommended]
    if rate is None and not any(s.holds for s in plan.scores):
        best = max(plan.scores, key=_rank)
        plan.recommended = best.layout
        plan.reason = (f"no layout of {plan.num_workers} workers meets the SLO for 90% of requests at any "
                       f"rate tried; {best.layout.label()} has the most goodput ({best.goodput:.2f} req/s at "
                       f"{_rate_text(best.rate)}): add workers or relax the SLO")
        return
    at_rate = next(s for s in plan.scores if s.layout == plan.recommended and s.rate == rate)
    plan.reason = (f"{plan.recommended.label()} holds {_rate_text(rate)} with "
                   f"{100 * at_rate.attainment:.0f}% SLO attainment ({_explain(at_rate)})")


def _plan_for_target(plan: Plan, profile: Profile, config: SimConfig, target_rate: float,
                     advance: Callable[[], None]) -> None:
    requests = plan.workload.requests(target_rate)
    for size in range(1, plan.num_workers + 1):
        tried = [score(simulate(layout, requests, config, profile.fits), plan.slo, target_rate)
                 for layout in layouts_of(size)]
        for _ in tried:
            advance()
        plan.target_tried += tried
        holding = [s for s in tried if s.holds]
        if holding:
            plan.target = max(holding, key=_rank)
            plan.recommended = plan.target.layout
            plan.reason = (f"{size} workers are the fewest that hold {target_rate:g} req/s: "
                           f"{plan.target.layout.label()} ({_explain(plan.target)})")
            return
    best = max(plan.target_tried, key=_rank)
    plan.recommended = best.layout
    plan.reason = (f"no layout of up to {plan.num_workers} workers holds {target_rate:g} req/s at 90% SLO "
                   f"attainment; the best of {plan.num_workers} reaches {100 * best.attainment:.0f}%")


def _rate_text(rate: float | None) -> str:
    return "the trace's own arrival times" if rate is None else f"{rate:g} req/s"


def _explain(s: LayoutScore) -> str:
    """Which pool is the bottleneck, from the workers' busy fractions."""
    busy = ", ".join(f"{kind} workers {100 * u:.0f}% busy" for kind, u in s.utilization.items())
    return f"TTFT p90 {1000 * s.ttft_p90_s:.0f} ms, ITL p99 {1000 * s.itl_p99_s:.0f} ms; {busy}"
