"""`pdserve tune validate`: measure the plan's predictions on a live server.

    read plan.json → check the server serves the plan's model → remember the server's layout
    → for each layout to check: PUT /admin/pools → for each of the plan's rates: `pdserve bench` with the
      plan's load (loadgen.runner.run_bench; the same requests the simulator saw) → predicted vs measured
    → per rate: is the measured best layout (most goodput) the predicted best among the layouts checked?
    → restore the server's layout; write validation.json next to the bench outputs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from loadgen.client import PINNED
from loadgen.runner import BenchConfig, run_bench
from tuner.apply import ServerAccess, apply_layout, check_model, current_layout

# Layouts whose measured goodput differs by less than this fraction are equally good: a run's noise.
GOODPUT_TIE = 0.05
# (name, plan.json table key, summary.json section, its percentile key)
FIGURES = (
    ("TTFT p50", "ttft_p50_s", "ttft_s_over_requests", "p50"),
    ("TTFT p90", "ttft_p90_s", "ttft_s_over_requests", "p90"),
    ("ITL p50", "itl_p50_s", "itl_s_over_tokens", "p50"),
    ("ITL p99", "itl_p99_s", "itl_s_over_tokens", "p99"),
)


@dataclass(frozen=True)
class Comparison:
    """One layout at one rate: what the plan said and what the bench measured."""

    label: str  # the layout, e.g. "1P+1D"
    rate: float | None
    predicted: dict[str, float]  # figure name → seconds (goodput: req/s)
    measured: dict[str, float]

    def error(self, name: str) -> float:
        """Relative error of the prediction (predicted / measured - 1)."""
        measured = self.measured[name]
        return self.predicted[name] / measured - 1.0 if measured else math.nan


def _bench_config(plan: dict[str, Any], rate: float | None, out_dir: Path, access: ServerAccess,
                  show_progress: bool, prompt_seed: int) -> BenchConfig:
    """The bench of the plan's load at `rate`: the arguments the planner gave plan_requests, with prompts
    of their own (`prompt_seed`): the simulator models no prefix-cache hit, and the runs before this one
    left their prompts in the workers' caches."""
    workload, slo = plan["workload"], plan["slo"]
    return BenchConfig(
        url=access.url, out_dir=out_dir, rate=rate, burstiness=float(workload["burstiness"]),
        speed=float(workload["speed"]), num_requests=int(workload["num_requests"]),
        input_len=workload["input_len"], output_len=workload["output_len"],
        dataset="trace" if workload["trace"] else "random",
        dataset_path=Path(workload["trace"]) if workload["trace"] else None,
        length_scale=float(workload["length_scale"]), ttft_slo_s=float(slo["ttft_s"]),
        itl_slo_s=float(slo["itl_s"]), vocab_size=int(plan["vocab_size"]), seed=int(workload["seed"]),
        prompt_seed=prompt_seed, api_key=access.api_key, show_progress=show_progress,
        options=PINNED,  # as the simulator planned it: greedy, exactly the planned output lengths
    )


def load_plan(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        plan = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(plan, dict) or not {"recommended", "table", "workload", "model"} <= set(plan):
        raise ValueError(f"{path}: not a plan; write one with `pdserve tune plan`")
    return plan


def validate(plan: dict[str, Any], access: ServerAccess, out_dir: Path, labels: list[str] | None = None,
             show_progress: bool = True) -> list[Comparison]:
    """Run the bench for each layout (default: every layout in the plan's table) at each of its rates."""
    check_model(access, str(plan["model"]))
    table = cast(list[dict[str, Any]], plan["table"])
    known = list(dict.fromkeys(str(row["label"]) for row in table))
    labels = labels or known
    unknown = [label for label in labels if label not in known]
    if unknown:
        raise ValueError(f"layouts {', '.join(unknown)} are not in the plan; it has {', '.join(known)}")
    original = current_layout(access)
    comparisons: list[Comparison] = []
    try:
        for label in labels:
            rows = [row for row in table if row["label"] == label]
            apply_layout(access, rows[0]["layout"])
            for row in rows:
                rate = row["rate"]
                out = out_dir / f"{label}-{'trace' if rate is None else f'{rate:g}'}"
                config = _bench_config(plan, rate, out, access, show_progress, prompt_seed=len(comparisons))
                summary: dict[str, Any] = run_bench(config)
                predicted = {name: float(row[key]) for name, key, _, _ in FIGURES}
                predicted["goodput"] = float(row["goodput"])
                measured = {name: float(summary[section][q]) for name, _, section, q in FIGURES}
                measured["goodput"] = float(summary["goodput"])
                comparisons.append(Comparison(label, rate, predicted, measured))
    finally:
        apply_layout(access, original)
    (out_dir / "validation.json").write_text(json.dumps(
        [{"label": c.label, "rate": c.rate, "predicted": c.predicted, "measured": c.measured}
         for c in comparisons], indent=1))
    return comparisons


def report(comparisons: list[Comparison]) -> str:
    """The printed table: predicted / measured per figure, and per rate whether the best layouts agree."""
    names = [name for name, *_ in FIGURES] + ["goodput"]
    lines = [f"{'layout':>8} {'rate':>6} " + " ".join(f"{name + ' pred/meas':>24}" for name in names)]
    for c in comparisons:
        cells = []
        for name in names:
            unit, scale = ("", 1.0) if name == "goodput" else ("ms", 1000.0)
            cells.append(f"{scale * c.predicted[name]:.1f}/{scale * c.measured[name]:.1f}{unit} "
                         f"({100 * c.error(name):+.0f}%)".rjust(24))
        lines.append(f"{c.label:>8} {'trace' if c.rate is None else f'{c.rate:g}':>6} " + " ".join(cells))
    for rate in dict.fromkeys(c.rate for c in comparisons):
        at_rate = [c for c in comparisons if c.rate == rate]
        predicted = max(at_rate, key=lambda c: c.predicted["goodput"])
        measured = max(at_rate, key=lambda c: c.measured["goodput"])
        if predicted is measured:
            verdict = "the same"
        elif predicted.measured["goodput"] >= (1 - GOODPUT_TIE) * measured.measured["goodput"]:
            verdict = f"a tie (measured goodput within {100 * GOODPUT_TIE:.0f}%)"
        else:
            verdict = "DIFFERENT"
        lines.append(f"rate {'trace' if rate is None else f'{rate:g}'}: predicted best {predicted.label}, "
                     f"measured best {measured.label}: {verdict}")
    return "\n".join(lines)
