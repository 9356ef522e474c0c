"""PNG plots of a run: CDFs of TTFT and ITL, stage breakdown by request percentile, queues over time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from loadgen.client import RequestRecord
from loadgen.sampler import Sample
from loadgen.summary import STAGES


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    ordered = sorted(values)
    if ordered:
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_run(records: list[RequestRecord], samples: list[Sample], out_dir: Path) -> list[Path]:
    ok = [r for r in records if not r.error and r.ttft_s is not None]
    written = []

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    _cdf(left, [1000 * r.ttft_s for r in ok if r.ttft_s is not None], "TTFT")
    left.set(xlabel="TTFT (ms, per request)", ylabel="fraction", title="TTFT CDF")
    _cdf(right, [1000 * g for r in ok for g in r.itls_s], "ITL")
    right.set(xlabel="inter-token latency (ms, per token)", title="ITL CDF")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    timed = sorted((r for r in ok if r.timings), key=lambda r: r.e2e_s or 0.0)
    if timed:
        fig, ax = plt.subplots(figsize=(8, 4))
        picks = {q: timed[min(len(timed) - 1, round(q / 100 * (len(timed) - 1)))] for q in (10, 50, 90, 99)}
        bottoms = [0.0] * len(picks)
        for stage in STAGES:
            heights = [r.timings[stage] if r.timings else 0.0 for r in picks.values()]
            ax.bar([f"p{q} e2e" for q in picks], heights, bottom=bottoms, label=stage.removesuffix("_ms"))
            bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
        ax.set(ylabel="ms", title="Where the time goes (requests at e2e percentiles)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "stage_breakdown.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)

    if samples:
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        times = [s.t_s for s in samples]
        for pool in sorted({p for s in samples for p in s.queued_prompt_tokens}):
            top.plot(times, [s.queued_prompt_tokens.get(pool, 0.0) for s in samples], label=pool)
        top.set(ylabel="queued prompt tokens", title="Queue depth and KV occupancy over time")
        top.legend(fontsize=8)
        for worker in sorted({w for s in samples for w in s.kv_occupancy}):
            bottom.plot(times, [s.kv_occupancy.get(worker, 0.0) for s in samples], label=worker)
        bottom.set(xlabel="s", ylabel="KV occupancy")
        bottom.legend(fontsize=8)
        fig.tight_layout()
        written.append(out_dir / "queues_over_time.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
