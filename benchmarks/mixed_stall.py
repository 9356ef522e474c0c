"""Where mixed workers' ITL tails came from, and the fix side by side (not a test).

Four streams (256-token prompts, 128 out, arriving 0.25 s apart) on 2 mixed workers with nothing else
running, against the same streams on 1P+1D; and 16 closed-loop clients (256 in / 64 out) for throughput.
Each layout runs as a real `pdserve serve` (SmolLM2-135M fp32, one torch thread per worker, nixl), from
this checkout and, with --base DIR
(a worktree of the previous commit), from that one too, alternating for --repeats rounds. For this
checkout's mixed server, the workers' step timelines (GET /admin/workers/{id}/steps) of the four-stream load
are kept: each step's duration, decode and prompt tokens, which shows what a long gap was.
Writes results.json and table.md under --out.

    .venv/bin/python benchmarks/mixed_stall.py --base /tmp/mixed-base [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_vs_colocated import served
from benchmarks.ratio_switch import VOCAB, closed16_load, drive, wait_for_layout
from loadgen.summary import SLO, percentile, summarize
from loadgen.workload import RequestSpec

# fp32, as the table: its prefill is slow enough on one core for a stall to show.
LAYOUTS = {"1P+1D": (["--prefill", "1", "--decode", "1", "--dtype", "float32"], (1, 1, 0)),
           "2 mixed": (["--mixed", "2", "--dtype", "float32"], (0, 0, 2))}


def four_streams() -> list[RequestSpec]:
    """Four streams arriving 0.25 s apart: each later prompt is prefilled while the earlier ones decode."""
    rng = random.Random(4)
    return [RequestSpec(i, 0.25 * i, tuple(rng.randrange(VOCAB) for _ in range(256)), 128) for i in range(4)]


async def steps_since(url: str, since: float) -> dict[str, list[dict[str, Any]]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        pools = (await client.get("/admin/pools")).json()
        return {w["worker_id"]: (await client.get(f"/admin/workers/{w['worker_id']}/steps",
                                                  params={"since": since})).json()["steps"]
                for w in pools["workers"]}


def run_layout(flags: list[str], layout: tuple[int, int, int], code_dir: Path | None, keep_steps: bool
               ) -> dict[str, Any]:
    with served([*flags, "--backend", "nixl"], code_dir) as url:
        asyncio.run(wait_for_layout(url, layout))
        asyncio.run(drive(url, four_streams()[:2]))  # warm-up
        started = time.time()
        records, _, _ = asyncio.run(drive(url, four_streams()))
        gaps = [gap for r in records for gap in r.itls_s]
        result: dict[str, Any] = {"streams_itl_p50_s": percentile(gaps, 50),
                                  "streams_itl_p99_s": percentile(gaps, 99), "streams_itl_max_s": max(gaps),
                                  "streams_ttft_max_s": max(r.ttft_s for r in records)}
        if keep_steps:
            with contextlib.suppress(httpx.HTTPError, KeyError):  # an earlier commit has no step timeline
                result["steps"] = asyncio.run(steps_since(url, started))
        records, _, _ = asyncio.run(drive(url, closed16_load(), clients=16))
        closed = summarize(records, SLO(1e9, 1e9))
        result["closed16_tok_s"] = closed["output_token_throughput"]
        result["closed16_ttft_p90_s"] = closed["ttft_s_over_requests"]["p90"]
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, help="a checkout of the commit to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/mixed_stall")
    args = parser.parse_args()
    sides: dict[str, Path | None] = {"now": None}
    if args.base:
        sides = {"before": args.base.resolve(), "after": None}
    runs: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.repeats):
        for layout, (flags, shape) in LAYOUTS.items():
            # 1P+1D's decode workers prefill nothing here: the reference runs from this checkout only.
            for side, code_dir in (sides if layout == "2 mixed" else {"(reference)": None}).items():
                keep = round_ == 0 and code_dir is None and layout == "2 mixed"
                result = run_layout(flags, shape, code_dir, keep)
                runs.setdefault(f"{layout} {side}", []).append(result)
                print(layout, side, {k: round(v, 3) for k, v in result.items() if isinstance(v, float)},
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1, default=str))
    keys = ("streams_itl_p50_s", "streams_itl_p99_s", "streams_itl_max_s", "streams_ttft_max_s",
            "closed16_tok_s", "closed16_ttft_p90_s")
    lines = [f"# Mixed workers' ITL tails ({datetime.now(UTC):%Y-%m-%d}, {args.repeats} rounds, medians "
             "[min–max])", "",
             "SmolLM2-135M fp32 on 2 CPU cores, one torch thread per worker, nixl. Four streams: 256-token "
             "prompts, 128 tokens out, sent 0.25 s apart, nothing else running. closed16: 16 clients, 256 in "
             "/ 64 out, back to back.",
             "Command: `.venv/bin/python benchmarks/mixed_stall.py"
             f"{' --base ' + str(args.base) if args.base else ''} --repeats {args.repeats}`", "",
             "| setup | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT max ms | closed16 tok/s | closed16 TTFT "
             "p90 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, results in runs.items():
        cells = []
        for key in keys:
            values = [r[key] for r in results]
            scale = 1 if key == "closed16_tok_s" else 1000
            spread = f" [{scale * min(values):.0f}–{scale * max(values):.0f}]" if len(values) > 1 else ""
            cells.append(f"{scale * statistics.median(values):.0f}{spread}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
