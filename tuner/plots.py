"""PNGs of the tuner: a profile's points against its fits, and a plan's goodput over layouts × rates."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from tuner.planner import Plan
from tuner.profile import Profile


def plot_profile(profile: Profile, path: Path) -> Path:
    fits = profile.fits
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    prefill, decode, mixed, transfer = axes.flat
    for kind, ax in (("prefill", prefill), ("mixed", mixed)):
        points = [p for p in profile.steps if p.kind == kind]
        measured = [1000 * p.seconds for p in points]
        predicted = [1000 * fits.step_s(p.batch, p.context, p.prefill_tokens, p.prefill_pairs)
                     for p in points]
        ax.scatter([p.prefill_tokens for p in points], measured, label="measured", s=18)
        ax.scatter([p.prefill_tokens for p in points], predicted, label="fit", marker="x", s=24)
        ax.set(xlabel="prompt tokens in the forward", ylabel="ms",
               title=f"{kind} forwards (fit rmse {1000 * getattr(fits, kind).rmse_s:.2f} ms)")
        ax.legend(fontsize=8)
    decodes = [p for p in profile.steps if p.kind == "decode"]
    for context_per_request in sorted({p.context // max(p.batch, 1) for p in decodes}):
        group = sorted((p for p in decodes if p.context // max(p.batch, 1) == context_per_request),
                       key=lambda p: p.batch)
        line = decode.plot([p.batch for p in group], [1000 * p.seconds for p in group], "o",
                           label=f"~{context_per_request} tokens/request")[0]
        decode.plot([p.batch for p in group], [1000 * fits.step_s(p.batch, p.context, 0, 0) for p in group],
                    "--", color=line.get_color())
    decode.set(xlabel="decode batch", ylabel="ms",
               title=f"decode forwards: points, fit dashed (rmse {1000 * fits.decode.rmse_s:.2f} ms)")
    decode.legend(fontsize=8)
    sizes = [p.bytes for p in profile.transfers]
    transfer.plot([b / (1 << 20) for b in sizes], [1000 * p.seconds for p in profile.transfers], "o",
                  label="measured")
    transfer.plot([b / (1 << 20) for b in sizes], [1000 * fits.transfer_s(b) for b in sizes], "--",
                  label="fit")
    transfer.set(xlabel="MiB", ylabel="ms", title="KV transfer")
    transfer.legend(fontsize=8)
    fig.suptitle(f"{profile.model} {profile.dtype} on {profile.hardware}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_goodput_heatmap(plan: Plan, path: Path) -> Path:
    layouts = sorted({s.layout for s in plan.scores}, reverse=True)
    rates = list(plan.rates)
    grid = [[0.0] * len(rates) for _ in layouts]
    attainment = [[0.0] * len(rates) for _ in layouts]
    for s in plan.scores:
        row, column = layouts.index(s.layout), rates.index(s.rate)
        grid[row][column], attainment[row][column] = s.goodput, s.attainment
    fig, ax = plt.subplots(figsize=(2 + 1.4 * len(rates), 1.5 + 0.3 * len(layouts)))
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(rates)), [("trace" if r is None else f"{r:g}") for r in rates])
    ax.set_yticks(range(len(layouts)), [layout.label() for layout in layouts], fontsize=7)
    ax.set(xlabel="offered rate (req/s)", ylabel="layout",
           title=f"goodput (req/s), SLO attainment %; recommended {plan.recommended.label()}")
    if len(layouts) <= 40:
        for row in range(len(layouts)):
            for column in range(len(rates)):
                ax.text(column, row, f"{grid[row][column]:.2f} ({100 * attainment[row][column]:.0f}%)",
                        ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(image, ax=ax, label="goodput (req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
