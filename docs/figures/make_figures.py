"""(Over 300 lines: one function per figure of the docs, run together.)

Draw the figures of README.md and docs/ from results kept in the repository; nothing is measured here.

Run from the repository root: `.venv/bin/python docs/figures/make_figures.py` (writes docs/figures/*.svg|png).
Each figure names its data file in its caption and in SOURCES below; the pages that show it cite the same
file. The data files under docs/figures/data/ are cut from the benchmarks' own output, which is not kept in
git (benchmarks/results/, ignored): after a rerun of a benchmark, `make_figures.py --refresh` cuts them
again from benchmarks/results/ (CUTS below says from which file and what is kept of it), then draws.

- request_way.svg: a request's way (gateway → prefill → KV → decode → gateway) over the stage timings one
  1P+1D response reported (data/ratio_switch.json: benchmarks/ratio_switch.py's run 5, the phased load's
  median request).
- vs_vllm.png: pdserve beside vLLM's CPU server (data/vs_vllm.json: benchmarks/vs_vllm.py, 2026-12-01).
- ratio_timeline.png: `--ratio auto`'s layout over time on two loads (data/ratio_switch.json).
- stage_breakdown.png: mean time per stage by layout on the phased load (same file).
- tuner_heatmap.png: `pdserve tune plan` over every 16-worker layout
  (data/plan_{decode,prefill}-heavy-16.json: the plans of benchmarks/tune_accuracy.py's larger cluster).
- pd_vs_colocated.png is not drawn here: benchmarks/pd_vs_colocated.py draws it (its comparison.png), copied.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyBboxPatch

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
DATA = "docs/figures/data"
SOURCES = {
    "request_way.svg": f"{DATA}/ratio_switch.json",
    "vs_vllm.png": f"{DATA}/vs_vllm.json",
    "ratio_timeline.png": f"{DATA}/ratio_switch.json",
    "stage_breakdown.png": f"{DATA}/ratio_switch.json",
    "tuner_heatmap.png": f"{DATA}/plan_{{decode,prefill}}-heavy-16.json",
}
# The stages and hops of a response's `timings`, in the order a request meets them; they add up to e2e_ms.
STAGES = ["gateway_queue", "to_prefill", "prefill_queue", "prefill", "handoff", "transfer", "decode_queue",
          "decode", "delivery"]
COLORS = {"gateway_queue": "#9e9e9e", "to_prefill": "#cfcfcf", "prefill_queue": "#f4b183",
          "prefill": "#e07b39", "handoff": "#e8e8e8", "transfer": "#8064a2", "decode_queue": "#9dc3e6",
          "decode": "#2e75b6", "delivery": "#bdbdbd"}
ROLE_COLORS = {"prefill": "#e07b39", "decode": "#2e75b6", "mixed": "#70ad47"}


def load(path: str) -> Any:
    return json.loads((ROOT / path).read_text())


def save(fig: plt.Figure, name: str) -> None:
    path = OUT / name
    if name.endswith(".svg"):
        fig.savefig(path, format="svg", metadata={"Date": None})
    else:
        fig.savefig(path, dpi=80, metadata={"Software": None})
    plt.close(fig)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB) from {SOURCES[name]}")


def median_request(records: list[dict[str, Any]]) -> dict[str, Any]:
    done = sorted((r for r in records if r["status"] == 200), key=lambda r: r["e2e_s"])
    return done[len(done) // 2]


def request_way() -> None:
    results = load(SOURCES["request_way.svg"])
    request = median_request(results["results"]["1P+1D"]["phased"]["records"])
    timings = request["timings"]
    plt.rcParams["svg.fonttype"] = "none"  # text stays text: a small file
    plt.rcParams["svg.hashsalt"] = "pdserve"  # the same ids on every run: no diff without a change
    fig, ax = plt.subplots(figsize=(11, 4.4))
    ax.set_xlim(0, 103)
    ax.set_ylim(0, 46)
    ax.axis("off")
    boxes = [  # (x, width, label, detail, colour)
        (0.5, 10, "client", "POST /v1/…", "#eeeeee"),
        (18.5, 15, "gateway", "validate, tokenize;\nadmission (decode KV);\nrouter: pick D, then P",
         "#d9d9d9"),
        (41.5, 15, "prefill worker", "prompt in chunks\ninto its paged KV;\nfirst token + KVHandle",
         "#f8cbad"),
        (64.5, 15, "decode worker", "pulls the KV blocks;\njoins its batch;\none token per step", "#bdd7ee"),
        (87.5, 15, "gateway", "detokenize,\nstream SSE,\nrecord timings", "#d9d9d9"),
    ]
    for x, width, label, detail, colour in boxes:
        ax.add_patch(FancyBboxPatch((x, 24), width, 18, boxstyle="round,pad=0.4", fc=colour, ec="#555555"))
        ax.text(x + width / 2, 39, label, ha="center", va="center", fontsize=10, weight="bold")
        ax.text(x + width / 2, 30.5, detail, ha="center", va="center", fontsize=7.5)
    arrows = [(10.9, 18.1, "request"), (33.9, 41.1, "prompt ids\n(Ray call)"),
              (56.9, 64.1, "KV blocks\n(NIXL READ)"), (79.9, 87.1, "tokens\n(stream)")]
    for x0, x1, text in arrows:
        ax.annotate("", xy=(x1, 33), xytext=(x0, 33), arrowprops={"arrowstyle": "->", "lw": 1.5})
        ax.text((x0 + x1) / 2, 35, text, ha="center", va="bottom", fontsize=7)
    # The timings of one response, each stage an equal cell (not to scale): the parts add up to e2e_ms.
    ax.text(0.5, 19.5, f"timings of one response (1P+1D, {request['input_len']} prompt tokens, "
            f"{request['output_len']} output tokens): the parts add up to "
            f"e2e_ms = {timings['e2e_ms']:.0f} ms (cells not to scale)", fontsize=8.5)
    width = 102 / len(STAGES)
    for i, stage in enumerate(STAGES):
        x = 0.5 + i * width
        ax.add_patch(plt.Rectangle((x, 8), width - 0.4, 9, fc=COLORS[stage], ec="white"))
        ax.text(x + width / 2, 14.2, stage.replace("_", "\n", 1) if len(stage) > 9 else stage,
                ha="center", va="center", fontsize=7.5)
        ax.text(x + width / 2, 9.8, f"{timings[stage + '_ms']:.1f} ms", ha="center", va="center", fontsize=8,
                weight="bold")
    ax.text(0.5, 3, f"ttft_ms = {timings['ttft_ms']:.0f}: the first token is the prefill worker's, "
            "so TTFT ends with prefill, before handoff and transfer.\n"
            f"Source: {SOURCES['request_way.svg']} (phased load, the request of median end-to-end time).",
            fontsize=7.5, color="#444444")
    save(fig, "request_way.svg")
    plt.rcParams["svg.fonttype"] = "path"


def vs_vllm() -> None:
    data = load(SOURCES["vs_vllm.png"])
    servers = data["servers"]
    order = ["vllm", "vllm-2t", "pd", "mixed"]
    labels = {"vllm": "vLLM\n1 thread", "vllm-2t": "vLLM\n2 threads", "pd": "pdserve\n1P+1D",
              "mixed": "pdserve 2 mixed\n--ratio auto"}
    colours = {"vllm": "#7f7f7f", "vllm-2t": "#404040", "pd": "#2e75b6", "mixed": "#70ad47"}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    x = range(len(order))
    ax = axes[0]
    ax.bar(x, [servers[s]["concurrent"]["output_tok_per_s"] for s in order],
           color=[colours[s] for s in order])
    ax.set_title("16 clients, 256 in / 64 out:\noutput tokens/s (higher is better)", fontsize=10)
    ax = axes[1]
    ax.bar(x, [servers[s]["single"]["ttft_ms_p50"] for s in order], color=[colours[s] for s in order])
    ax.set_title("one request at a time:\nTTFT ms, median (lower is better)", fontsize=10)
    ax = axes[2]
    alone = [servers[s]["interference"]["itl_ms_p99_alone"] for s in order]
    busy = [servers[s]["interference"]["itl_ms_p99"] for s in order]
    ax.bar([i - 0.2 for i in x], alone, width=0.4, color="#bbbbbb", label="streams alone")
    ax.bar([i + 0.2 for i in x], busy, width=0.4, color=[colours[s] for s in order],
           label="two 1500-token prompts arrive")
    ax.set_title("4 decoding streams: ITL p99 ms\n(lower is better)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(0, max(busy) * 1.35)
    for ax in axes:
        ax.set_xticks(list(x), [labels[s] for s in order], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        for bar in ax.patches:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{bar.get_height():.0f}",
                    ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"SmolLM2-135M bf16, 2-core Intel Xeon (AMX), one client; source: {SOURCES['vs_vllm.png']}",
                 fontsize=9)
    fig.tight_layout()
    save(fig, "vs_vllm.png")


def ratio_timeline() -> None:
    results = load(SOURCES["ratio_timeline.png"])["results"]["auto"]
    loads = [("phased", "phased chat load: light, long prompts mixed in, light"),
             ("burst", "4 streams decoding, two 1500-token prompts arrive")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 5), sharex="col", gridspec_kw={"height_ratios": [1, 1]})
    for col, (name, title) in enumerate(loads):
        timeline = results[name]["timeline"]
        t = [s["t"] for s in timeline]
        ax = axes[0][col]
        ax.stackplot(t, *[[s[role] for s in timeline] for role in ROLE_COLORS],
                     labels=list(ROLE_COLORS), colors=list(ROLE_COLORS.values()), step="post")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("active workers")
        ax.set_ylim(0, 2.2)
        for decision in results[name]["decisions"]:
            ax.text(0.98, 0.1, f"decision: {decision['reason']} ({decision['from_level']} → "
                    f"{decision['to_level']} prefill)", transform=ax.transAxes, ha="right", fontsize=8)
        ax = axes[1][col]
        ax.plot(t, [s["queued_prompt_tokens"] for s in timeline], color="#c00000", drawstyle="steps-post")
        ax.set_ylabel("prompt tokens\nnot yet prefilled")
        ax.set_xlabel("seconds")
        for a in axes[:, col]:
            a.grid(alpha=0.3)
    axes[0][0].legend(loc="lower left", fontsize=8)
    fig.suptitle(f"--ratio auto on 2 workers (run 5); source: {SOURCES['ratio_timeline.png']}", fontsize=9)
    fig.tight_layout()
    save(fig, "ratio_timeline.png")


def stage_breakdown() -> None:
    results = load(SOURCES["stage_breakdown.png"])["results"]
    setups = ["1P+1D", "2 mixed", "auto"]
    fig, ax = plt.subplots(figsize=(10, 2.8))
    for row, setup in enumerate(setups):
        records = [r for r in results[setup]["phased"]["records"] if r["status"] == 200]
        left = 0.0
        for stage in STAGES:
            mean = statistics.fmean(r["timings"][stage + "_ms"] for r in records)
            ax.barh(row, mean, left=left, color=COLORS[stage], edgecolor="white",
                    label=stage if row == 0 else None)
            if mean > 60:
                ax.text(left + mean / 2, row, f"{mean:.0f}", ha="center", va="center", fontsize=7)
            left += mean
        ax.text(left + 20, row, f"{left:.0f} ms (n={len(records)})", va="center", fontsize=8)
    ax.set_yticks(range(len(setups)), setups)
    ax.invert_yaxis()
    ax.set_xlabel("mean ms per request, stacked (adds up to the mean end-to-end time)")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
    ax.legend(ncol=5, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    ax.set_title(f"Where a request's time goes, phased chat load; source: {SOURCES['stage_breakdown.png']}",
                 fontsize=9)
    fig.tight_layout()
    save(fig, "stage_breakdown.png")


def tuner_heatmap() -> None:
    panels = [("decode-heavy-16", "goodput", "goodput req/s"),
              ("prefill-heavy-16", "ttft_p90_s", "TTFT p90 s")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, (name, key, what) in zip(axes, panels, strict=True):
        plan = load(f"{DATA}/plan_{name}.json")
        n = plan["num_workers"]
        grid = [[float("nan")] * (n + 1) for _ in range(n + 1)]
        for row in plan["table"]:
            grid[row["layout"]["prefill"]][row["layout"]["mixed"]] = row[key]
        image = ax.imshow(grid, origin="lower", cmap="viridis" if key == "goodput" else "viridis_r")
        fig.colorbar(image, ax=ax, label=what)
        best = plan["recommended"]
        ax.plot(best["mixed"], best["prefill"], marker="*", color="red", markersize=14)
        workload = plan["workload"]
        ax.set_title(f"{n} workers, {workload['input_len']} in / {workload['output_len']} out at "
                     f"{plan['rates'][0]:g} req/s: {what}\n(★ recommended; decode workers = {n} − P − M)",
                     fontsize=9)
        ax.set_xticks(range(0, n + 1, 2))
        ax.set_yticks(range(0, n + 1, 2))
        ax.set_xlabel("mixed workers M")
        ax.set_ylabel("prefill workers P")
    fig.suptitle(f"pdserve tune plan over every layout; source: {SOURCES['tuner_heatmap.png']}", fontsize=9)
    fig.tight_layout()
    save(fig, "tuner_heatmap.png")


# What the data files keep of each benchmark's output: the fields the figures draw.
RECORD_FIELDS = ("status", "e2e_s", "input_len", "output_len")
TIMING_FIELDS = [f"{stage}_ms" for stage in STAGES] + ["ttft_ms", "e2e_ms"]


def cut_ratio_switch(results: dict[str, Any]) -> dict[str, Any]:
    """Run 5's results.json (658 KB) cut to what the figures read: the phased load's requests of 1P+1D,
    2 mixed and auto (their lengths, status, end-to-end time and stage timings), auto's timelines and
    decisions on the phased and burst loads. The per-phase summaries are in docs/benchmarks.md."""
    cut: dict[str, Any] = {"args": results["args"], "results": {}}
    for setup in ("1P+1D", "2 mixed", "auto"):
        records = results["results"][setup]["phased"]["records"]
        kept: dict[str, Any] = {"phased": {"records": [
            {**{k: r[k] for k in RECORD_FIELDS},
             "timings": {k: r["timings"][k] for k in TIMING_FIELDS} if r["timings"] else None}
            for r in records]}}
        if setup == "auto":
            for load_name in ("phased", "burst"):
                run = results["results"][setup][load_name]
                kept.setdefault(load_name, {}).update(timeline=run["timeline"], decisions=run["decisions"])
        cut["results"][setup] = kept
    return cut


def cut_plan(plan: dict[str, Any]) -> dict[str, Any]:
    """A `pdserve tune plan` plan.json without max_rate_held; each layout's row keeps what the heat map
    draws (goodput, TTFT p90) beside its label, SLO attainment and ITL p99."""
    row_fields = ("layout", "label", "rate", "goodput", "attainment", "ttft_p90_s", "itl_p99_s")
    return {**{k: v for k, v in plan.items() if k not in ("table", "max_rate_held")},
            "table": [{k: row[k] for k in row_fields} for row in plan["table"]]}


CUTS = {  # data file: (the benchmark's output under benchmarks/results/, what is kept of it)
    "ratio_switch.json": ("benchmarks/results/ratio_switch/results.json", cut_ratio_switch),
    "vs_vllm.json": ("benchmarks/results/vs_vllm.json", lambda data: data),
    "plan_decode-heavy-16.json": ("benchmarks/results/tune/decode-heavy-16/plan.json", cut_plan),
    "plan_prefill-heavy-16.json": ("benchmarks/results/tune/prefill-heavy-16/plan.json", cut_plan),
}


def refresh() -> None:
    """Cut docs/figures/data/ again from the benchmarks' output under benchmarks/results/."""
    for name, (source, cut) in CUTS.items():
        path = ROOT / DATA / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(cut(load(source)), indent=1) + "\n")
        print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size // 1024} KiB) from {source}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", action="store_true",
                        help="cut docs/figures/data/ again from benchmarks/results/ first")
    if parser.parse_args().refresh:
        refresh()
    request_way()
    vs_vllm()
    ratio_timeline()
    stage_breakdown()
    tuner_heatmap()


if __name__ == "__main__":
    main()
