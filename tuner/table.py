"""The plan as `pdserve tune plan` prints it: a table per rate, the best layouts, and the recommendation."""

from __future__ import annotations

from tuner.metrics import LayoutScore
from tuner.planner import Plan
from tuner.profile import Profile
from tuner.simulator import Layout

# Beyond this many layouts per rate, only the best are printed (plan.json has them all).
MAX_ROWS = 20


def _row(s: LayoutScore, is_best: bool) -> str:
    busy = " ".join(f"{kind[0].upper()}{100 * u:.0f}%" for kind, u in s.utilization.items())
    return (f"{'*' if is_best else ' '}{s.layout.label():>10} {100 * s.attainment:6.1f}% {s.goodput:8.2f} "
            f"{1000 * s.ttft_p50_s:8.0f} {1000 * s.ttft_p90_s:8.0f} {1000 * s.ttft_p99_s:8.0f} "
            f"{1000 * s.itl_p50_s:7.1f} {1000 * s.itl_p99_s:7.1f} {s.backlog_growth:+7.2f}  {busy}")


def recommendation(layout: Layout, reason: str) -> list[str]:
    """The recommended layout as a small table of workers per pool, and the commands that set it up."""
    counts = layout.to_dict()
    flags = " ".join(f"--{kind} {n}" for kind, n in counts.items() if n)
    return [
        f"recommended: {layout.label()} — {reason}",
        "  " + " " * 7 + "".join(f"{kind:>9}" for kind in counts),
        "  workers" + "".join(f"{n:>9}" for n in counts.values()),
        f"  start a server with it: pdserve serve ... {flags}",
        "  or set it on a running one: pdserve tune plan ... --apply URL",
    ]


def print_plan(plan: Plan, profile: Profile) -> None:
    print(f"{profile.model} ({profile.dtype}, {profile.hardware}); {plan.workload.describe()}; SLO TTFT <= "
          f"{plan.slo.ttft_s:g} s and TPOT <= {plan.slo.itl_s:g} s")
    header = (f" {'layout':>10} {'SLO ok':>7} {'goodput':>8} {'TTFT p50':>8} {'p90':>8} {'p99':>8} "
              f"{'ITL p50':>7} {'p99':>7} {'backlog':>7}  busy   (ms; goodput req/s; backlog: requests/s)")
    for rate in plan.rates:
        at_rate = sorted((s for s in plan.scores if s.rate == rate), key=lambda s: -s.goodput)
        best = plan.best_by_rate[rate]
        shown = at_rate[:MAX_ROWS]
        print(f"\nrate {'(trace times)' if rate is None else f'{rate:g} req/s'}: best {best.layout.label()}")
        print(header)
        for s in shown:
            print(_row(s, s is best))
        if len(at_rate) > len(shown):
            print(f"  ... {len(at_rate) - len(shown)} more layouts in plan.json")
    held = sorted(plan.max_rate_held.items(), key=lambda item: -(item[1] or 0.0))
    print("\nhighest rate held at >= 90% SLO attainment (of the rates tried):")
    print("  " + ", ".join(f"{layout.label()}: {'none' if rate is None else f'{rate:g}'}"
                           for layout, rate in held[:MAX_ROWS]))
    if plan.target_rate is not None:
        found = plan.target
        print(f"\ntarget {plan.target_rate:g} req/s: " + (
            f"fewest workers {found.layout.num_workers}, split {found.layout.label()}" if found
            else f"not held by any layout of up to {plan.num_workers} workers"))
    print("\n" + "\n".join(recommendation(plan.recommended, plan.reason)))
