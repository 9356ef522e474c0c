"""table.md and timeline.png of a ratio_switch run: fixed layouts against `--ratio auto`, side by side."""

from __future__ import annotations

import argparse
import statistics
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PHASES = ("light", "long prompts", "light again")


def _row(name: str, phase: str, s: dict[str, Any]) -> str:
    return (f"| {phase} | {name} | {s['num_ok']}/{s['num_requests']} | "
            f"{1000 * s['itl_s_over_tokens']['p99']:.0f} | {1000 * s['ttft_s_over_requests']['p90']:.0f} | "
            f"{s['goodput']:.3f} |")


def _commit(checkout: Path) -> str:
    """The checkout's commit, for the table's header."""
    done = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h (%s)"],
                          capture_output=True, text=True)
    return done.stdout.strip()[:100] or str(checkout)


def plan_check(decision: dict[str, Any]) -> str:
    """A planned decision's measured outcome, beside what it predicted."""
    measured = decision["measured"]
    predicted = decision["prediction"]["layouts"].get(decision["prediction"]["best"], {})
    return (f"TTFT p90 {measured.get('ttft_p90_s')} s, TPOT p90 {measured.get('tpot_p90_s')} s, attainment "
            f"{measured.get('attainment')} (predicted TTFT p90 {predicted.get('ttft_p90_s')} s, attainment "
            f"{predicted.get('attainment')})")


def write_report(results: dict[str, Any], args: argparse.Namespace, out: Path) -> None:
    lines = [
        f"# Fixed layouts against the ratio controller ({datetime.now(UTC):%Y-%m-%d})",
        "",
        "SmolLM2-135M (the servers' default dtype: bf16 where the CPU runs it natively, else fp32) on 2 CPU "
        "cores, one torch thread per worker, nixl. Phased load: Azure "
        f"conversation trace (lengths × 0.25), Poisson {args.chat_rate} req/s for three phases of "
        f"{args.phase_s:.0f} s; in the middle phase also {args.long_len}-token prompts (32 out) at "
        f"{args.long_rate} req/s. Goodput SLO: "
        f"TTFT ≤ {args.ttft_slo} s and TPOT ≤ {args.itl_slo} s. Each setup is its own server, run one after "
        "another in one invocation.",
        "Command: `.venv/bin/python benchmarks/ratio_switch.py"
        + (f" --base {args.base}`; \"auto @base\" is `--ratio auto` from {_commit(args.base)}"
           if getattr(args, "base", None) else "`"),
        "",
        "| phase | setup | ok/requests | ITL p99 ms | TTFT p90 ms | goodput req/s |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for phase in (*PHASES, "overall"):
        for name, result in results.items():
            phased = result["phased"]
            summary = phased["overall"] if phase == "overall" else phased["phases"][phase]
            lines.append(_row(name, phase, summary))
    lines += ["", "Closed workloads:", "",
              "| setup | 16 clients 256/64: output tok/s | TTFT p90 ms | 4 streams alone: ITL p99 ms (max) | "
              "4 streams + 2×1500-token prompts: stream ITL p99 ms (max) | burst output tok/s |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, result in results.items():
        closed, burst = result["closed16"], result["burst"]
        alone = result.get("alone")
        alone_cell = (f"{1000 * alone['stream_itl_p99_s']:.0f} ({1000 * alone['stream_itl_max_s']:.0f})"
                      if alone else "–")
        lines.append(f"| {name} | {closed['output_token_throughput']:.1f} | "
                     f"{1000 * closed['ttft_s_over_requests']['p90']:.0f} | {alone_cell} | "
                     f"{1000 * burst['stream_itl_p99_s']:.0f} ({1000 * burst['stream_itl_max_s']:.0f}) | "
                     f"{burst['output_token_throughput']:.1f} |")
    for auto in (name for name in results if name.startswith("auto")):
        lines += ["", f"{auto}: the controller's decisions (phased load):", ""]
        for d in results[auto]["phased"]["decisions"]:
            lines.append(f"- level {d['from_level']} → {d['to_level']} ({d['reason']}): {d['detail']}")
            if d.get("measured"):
                lines.append(f"  - measured {plan_check(d)}")
        for load in ("closed16", "burst", "alone"):
            decisions = results[auto].get(load, {}).get("decisions", [])
            reasons = [f"{d['from_level']}→{d['to_level']} {d['reason']}" for d in decisions]
            lines.append(f"- {load}: {', '.join(reasons) or 'no change'}")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if "auto" in results:
        plot_timeline(results["auto"]["phased"], args, out / "timeline.png")


def _spread(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """median [min–max] of the rounds' values."""
    values = sorted(v * scale for v in values)
    return f"{statistics.median(values):.{digits}f} [{values[0]:.{digits}f}–{values[-1]:.{digits}f}]"


def write_medians(rounds: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> None:
    """medians.md: each setup's headline figures, median [min–max] over the rounds (each round ran every
    setup one after another, so a noisy stretch of the machine touches them all alike)."""
    lines = [f"# Medians over {len(rounds)} rounds ({datetime.now(UTC):%Y-%m-%d}; workers {args.workers}, "
             f"model {args.model or 'default'}, dtype {args.dtype or 'default'})", "",
             "| setup | 16 clients: output tok/s | TTFT p90 ms | 4 streams alone: ITL p99 ms | "
             "streams + long prompts: ITL p99 ms | phased goodput req/s | phased TTFT p90 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in rounds[0]:
        mine = [r[name] for r in rounds if name in r]
        lines.append(" | ".join([
            f"| {name}",
            _spread([r["closed16"]["output_token_throughput"] for r in mine], digits=1),
            _spread([r["closed16"]["ttft_s_over_requests"]["p90"] for r in mine], 1000),
            _spread([r["alone"]["stream_itl_p99_s"] for r in mine], 1000),
            _spread([r["burst"]["stream_itl_p99_s"] for r in mine], 1000),
            _spread([r["phased"]["overall"]["goodput"] for r in mine], digits=3),
            _spread([r["phased"]["overall"]["ttft_s_over_requests"]["p90"] for r in mine], 1000)]) + " |")
    (out / "medians.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot_timeline(phased: dict[str, Any], args: argparse.Namespace, path: Path) -> None:
    timeline = phased["timeline"]
    t = [p["t"] for p in timeline]
    fig, (roles, queue) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    # Stacked: at 1P+1D the prefill and decode counts are equal, and lines would hide one another.
    roles.stackplot(t, *([p[role] for p in timeline] for role in ("prefill", "decode", "mixed")),
                    labels=("prefill", "decode", "mixed"), step="post", alpha=0.8)
    roles.set(ylabel="active workers (stacked)", title="--ratio auto: roles over time (phased load)")
    queue.plot(t, [p["queued_prompt_tokens"] for p in timeline], color="tab:red")
    queue.set(xlabel="seconds", ylabel="prompt tokens routed, not yet prefilled")
    for ax in (roles, queue):
        for boundary in (args.phase_s, 2 * args.phase_s):
            ax.axvline(boundary, color="grey", linestyle="--", alpha=0.6)
        ax.grid(alpha=0.3)
    roles.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
