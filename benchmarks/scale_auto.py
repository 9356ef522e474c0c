"""A fleet whose size follows the traffic (`--scale auto`) against fixed fleets, on a load that rises then
falls (not a test).

Each setup is a real `pdserve serve` on this machine's local Ray (the cores split over the most workers it may
have: 2 threads for 1 mixed, 1 each otherwise), driven by
the same Poisson load of three phases (light, busy, light; random-token prompts of --prompt-len for
--output-len tokens): the fixed fleets of 1 and 2 mixed workers, and `--scale auto --min-workers 1
--max-workers 2` from one mixed worker, planned with --profile (`pdserve tune profile`'s profile of this
machine and model: take one first, 45 s; benchmarks/profiles/ has an older one of this machine kind).
For each: SLO attainment and goodput per phase and
overall, and the workers it held over time (every second from GET /admin/pools: active and pending
workers, by role) and their time average; for auto, its decisions with their predictions and measured
outcomes. Writes results.json, table.md and timeline.png (workers per role, arrival rate and SLO attainment
over time, one panel column per setup) under --out.

    .venv/bin/pdserve tune profile --out /tmp/profile
    .venv/bin/python benchmarks/scale_auto.py --profile /tmp/profile/profile.json [--rates 0.3 2.5 0.3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shlex
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_vs_colocated import served
from loadgen.client import RequestRecord, send_one
from loadgen.summary import SLO
from loadgen.workload import RequestSpec, poisson_arrivals

VOCAB = 49152
PROFILE = "benchmarks/profiles/smollm2-135m-bf16-xeon.json"
SETUPS = {
    "1 mixed": ["--mixed", "1", "--backend", "nixl"],
    "2 mixed": ["--mixed", "2", "--backend", "nixl"],
    "scale auto 1..2": ["--mixed", "1", "--backend", "nixl", "--scale", "auto", "--min-workers", "1",
                        "--max-workers", "2"],
}
BIN_S = 10.0  # the timeline's bins


def phased_load(rates: list[float], phase_s: float, prompt_len: int, output_len: int, seed: int
                ) -> list[RequestSpec]:
    rng = random.Random(seed)
    specs: list[RequestSpec] = []
    for phase, rate in enumerate(rates):
        times = [t for t in poisson_arrivals(rate, int(rate * phase_s * 3) + 5, rng) if t < phase_s]
        for t in times:
            prompt = tuple(rng.randrange(VOCAB) for _ in range(prompt_len))
            specs.append(RequestSpec(len(specs), phase * phase_s + t, prompt, output_len))
    return specs


async def watch_workers(url: str, start: float, stop: asyncio.Event, samples: list[dict[str, Any]]) -> None:
    """Every second: the time, the workers by role and state, and the scale decisions so far."""
    async with httpx.AsyncClient(timeout=10) as client:
        while not stop.is_set():
            try:
                pools = (await client.get(f"{url}/admin/pools")).json()
                counts: dict[str, int] = {}
                for worker in pools["workers"]:
                    key = f"{worker['state']} {worker['role']}"
                    counts[key] = counts.get(key, 0) + 1
                samples.append({"t": time.perf_counter() - start, "workers": counts,
                                "scale": pools.get("scale")})
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)


async def run_setup(flags: list[str], specs: list[RequestSpec], model: str, tail_s: float
                    ) -> tuple[list[RequestRecord], list[dict[str, Any]]]:
    with served(flags) as url:
        samples: list[dict[str, Any]] = []
        stop = asyncio.Event()
        start = time.perf_counter()
        watcher = asyncio.create_task(watch_workers(url, start, stop, samples))
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            records = list(await asyncio.gather(*(send_one(client, s, model, start) for s in specs)))
        await asyncio.sleep(tail_s)  # the fleet after the load (auto shrinks)
        stop.set()
        await watcher
    return records, samples


def phase_figures(records: list[RequestRecord], slo: SLO, phase_s: float, num_phases: int
                  ) -> list[dict[str, float]]:
    figures = []
    for phase in range(num_phases + 1):  # the last: overall
        mine = records if phase == num_phases else [
            r for r in records if phase * phase_s <= r.scheduled_s < (phase + 1) * phase_s]
        span = phase_s * (num_phases if phase == num_phases else 1)
        met = sum(slo.is_met(r) for r in mine)
        figures.append({"requests": len(mine), "errors": sum(bool(r.error) for r in mine),
                        "attainment": met / len(mine) if mine else float("nan"), "goodput": met / span})
    return figures


def worker_seconds(samples: list[dict[str, Any]], until_s: float) -> float:
    """Time-averaged workers held (active or starting, not pending: a pending one holds no node)."""
    held = [(s["t"], sum(n for k, n in s["workers"].items() if not k.startswith("pending")))
            for s in samples if s["t"] <= until_s]
    if len(held) < 2:
        return float("nan")
    total = sum((b[0] - a[0]) * a[1] for a, b in itertools.pairwise(held))
    return total / (held[-1][0] - held[0][0])


def plot(results: dict[str, Any], slo: SLO, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(3, len(names), figsize=(4.2 * len(names), 7), sharex=True, squeeze=False)
    for column, name in enumerate(names):
        samples, records = results[name]["samples"], results[name]["records"]
        times = [s["t"] for s in samples]
        roles = sorted({k for s in samples for k in s["workers"]})
        axis = axes[0][column]
        for role in roles:
            axis.step(times, [s["workers"].get(role, 0) for s in samples], where="post", label=role)
        axis.set_title(name, fontsize=10)
        axis.set_ylabel("workers" if column == 0 else "")
        axis.legend(fontsize=7, loc="upper left")
        end = max([r["scheduled_s"] for r in records] + times + [1.0])
        bins = [i * BIN_S for i in range(int(end // BIN_S) + 1)]
        in_bin = [[r for r in records if b <= r["scheduled_s"] < b + BIN_S] for b in bins]
        axes[1][column].bar(bins, [len(x) / BIN_S for x in in_bin], width=BIN_S * 0.9, align="edge")
        axes[1][column].set_ylabel("arrivals, req/s" if column == 0 else "")
        attainment = [sum(r["met"] for r in x) / len(x) if x else None for x in in_bin]
        axes[2][column].plot([b + BIN_S / 2 for b, a in zip(bins, attainment, strict=True) if a is not None],
                             [a for a in attainment if a is not None], marker="o")
        axes[2][column].set_ylim(-0.05, 1.05)
        axes[2][column].set_ylabel("SLO attainment" if column == 0 else "")
        axes[2][column].set_xlabel("s")
    fig.suptitle(f"TTFT ≤ {slo.ttft_s:g} s, TPOT ≤ {slo.itl_s * 1000:g} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.3, 2.5, 0.3], help="req/s per phase")
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ttft-slo-s", type=float, default=1.0)
    parser.add_argument("--itl-slo-s", type=float, default=0.08)
    parser.add_argument("--profile", default=PROFILE, help="the scale controller's (pdserve tune profile)")
    parser.add_argument("--tail-s", type=float, default=60.0, help="watching the fleet after the load")
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/scale_auto"))
    parser.add_argument("--serve-flags", default="",
                        help='more `pdserve serve` flags for every setup, e.g. "--dtype float32" (where '
                             '--compile auto runs eager: an added worker serves at full speed from its load; '
                             'take the profile with the same flags)')
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    slo = SLO(args.ttft_slo_s, args.itl_slo_s)
    specs = phased_load(args.rates, args.phase_s, args.prompt_len, args.output_len, seed=11)
    common = ["--ttft-slo-s", str(args.ttft_slo_s), "--itl-slo-s", str(args.itl_slo_s), "--scale-window-s",
              "30", "--scale-in-calm-s", "20"]
    results: dict[str, Any] = {}
    for name in args.setups:
        scaled = "--scale" in SETUPS[name]
        flags = (SETUPS[name] + ([*common, "--profile", args.profile] if scaled else common[:4])
                 + shlex.split(args.serve_flags))
        print(f"{name}: {len(specs)} requests over {len(args.rates)} phases", flush=True)
        records, samples = asyncio.run(run_setup(flags, specs, "SmolLM2-135M-Instruct", args.tail_s))
        load_end = len(args.rates) * args.phase_s
        results[name] = {
            "phases": phase_figures(records, slo, args.phase_s, len(args.rates)),
            "mean_workers": worker_seconds(samples, load_end),
            "records": [{"scheduled_s": r.scheduled_s, "met": slo.is_met(r), "ttft_s": r.ttft_s,
                         "tpot_s": r.tpot_s, "error": r.error} for r in records],
            "samples": samples,
            "decisions": (samples[-1]["scale"] or {}).get("decisions", []) if samples else [],
        }
        overall = results[name]["phases"][-1]
        print(f"  attainment {overall['attainment']:.2f}, goodput {overall['goodput']:.2f} req/s, "
              f"mean workers {results[name]['mean_workers']:.2f}", flush=True)
    (args.out / "results.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                       "results": results}, indent=1))
    lines = ["| setup | mean workers | " + " | ".join(f"phase {i + 1} ({r:g} req/s) attainment / goodput"
                                                     for i, r in enumerate(args.rates)) + " | overall |",
             "|---|---:|" + "---:|" * (len(args.rates) + 1)]
    for name, result in results.items():
        cells = [f"{p['attainment']:.2f} / {p['goodput']:.2f}" for p in result["phases"]]
        lines.append(f"| {name} | {result['mean_workers']:.2f} | " + " | ".join(cells) + " |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, slo, args.out)


if __name__ == "__main__":
    main()
