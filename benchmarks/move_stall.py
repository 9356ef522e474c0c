"""How long a role change stalls the streams it moves (not a test).

Two mixed workers (SmolLM2-135M, one torch thread each, nixl) decode four streams (256-token prompts, 300
tokens out); three seconds in, `PUT /admin/pools {"prefill": 1, "decode": 1, "drain_grace_s": 0}` moves one
worker to prefill, so its streams are handed to the other (their KV pulled from the worker they leave).
Reports each stream's largest gap and the gaps around the move, the moved streams' (timings.num_moves > 0)
apart, and the receiving worker's steps in that window (GET /admin/workers/{id}/steps), --repeats times.
With --base DIR (a worktree of an earlier commit), the same from that checkout, alternating.

    .venv/bin/python benchmarks/move_stall.py [--base /tmp/base] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_vs_colocated import served
from benchmarks.ratio_switch import VOCAB, wait_for_layout


async def stream(client: httpx.AsyncClient, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    timings: dict[str, Any] = {}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") is not None:
                times.append(time.time())
            timings = event.get("timings") or timings
    return {"times": times, "num_moves": timings.get("num_moves", 0)}


async def run_once(url: str) -> dict[str, Any]:
    rng = random.Random(5)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = [[rng.randrange(VOCAB) for _ in range(256)] for _ in range(4)]
        tasks = [asyncio.ensure_future(stream(client, model, p)) for p in prompts]
        await asyncio.sleep(3.0)
        moved_at = time.time()
        answer = await client.put("/admin/pools", json={"prefill": 1, "decode": 1, "drain_grace_s": 0})
        moved_until = time.time()
        results = await asyncio.gather(*tasks)
        pools = (await client.get("/admin/pools")).json()
        decode = next(w["worker_id"] for w in pools["workers"] if w["role"] == "decode")
        steps = (await client.get(f"/admin/workers/{decode}/steps", params={"since": moved_at - 1})).json()
    out: dict[str, Any] = {"put_s": moved_until - moved_at, "put_status": answer.status_code, "streams": []}
    for result in results:
        times = result["times"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        around = [b - a for a, b in itertools.pairwise(times) if b >= moved_at - 0.5 and a <= moved_until + 2]
        out["streams"].append({"moved": result["num_moves"] > 0, "max_gap_s": max(gaps, default=0.0),
                               "max_gap_around_move_s": max(around, default=0.0), "tokens": len(times)})
    out["receiver_steps"] = [s for s in steps.get("steps", []) if s["started"] <= moved_until + 2]
    return out


def run(code_dir: Path | None) -> dict[str, Any]:
    with served(["--mixed", "2", "--backend", "nixl", "--dtype", "float32"], code_dir) as url:
        asyncio.run(wait_for_layout(url, (0, 0, 2)))
        return asyncio.run(run_once(url))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/move_stall")
    args = parser.parse_args()
    sides: dict[str, Path | None] = {"now": None}
    if args.base:
        sides = {"before": args.base.resolve(), "after": None}
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, code_dir in sides.items():
            result = run(code_dir)
            runs[side].append(result)
            moved = [s["max_gap_around_move_s"] for s in result["streams"] if s["moved"]]
            print(side, "PUT", round(result["put_s"], 2), "s; moved streams' largest gap around the move",
                  [round(g, 2) for g in moved], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(runs, indent=1))
    lines = ["| code | PUT s | moved streams | moved streams' largest gap s (median [min–max]) | others' |",
             "|---|---:|---:|---:|---:|"]
    for side, results in runs.items():
        moved = [s["max_gap_around_move_s"] for r in results for s in r["streams"] if s["moved"]]
        others = [s["max_gap_around_move_s"] for r in results for s in r["streams"] if not s["moved"]]

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}]" if values else "–"

        lines.append(f"| {side} | {statistics.median(r['put_s'] for r in results):.2f} | {len(moved)} | "
                     f"{cell(moved)} | {cell(others)} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
