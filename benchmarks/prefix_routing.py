"""Prefix-aware against least-loaded prefill routing, replaying Mooncake's conversation trace (not a test).

The trace (kvcache-ai/Mooncake, FAST25-release/traces/conversation_trace.jsonl, Apache-2.0: 12,031 requests
over an hour, each with its arrival in ms, input and output lengths, and `hash_ids`: one id per 512-token
block of its prompt, equal ids for equal prefixes) is replayed through a real fleet (`--prefill 2
--decode 1`, the default model) twice, the same requests each time: `--prefill-routing prefix` (the router's
default: the fewest prompt tokens queued less those a worker's prefix cache probably holds) and
`--prefill-routing load` (the fewest queued).

At a scale this 2-core machine can serve: conversations, not a time window, are sampled (a window of a few
hundred consecutive requests shares little but the system prompt: its turns are minutes apart), every
request of `--conversations` of them (grouped by their first block after the shared one), their arrivals
compressed into `--duration-s`; prompt and output lengths × `--length-scale` (1/32: a 512-token block is 16
tokens, one KV block), outputs capped at `--max-output`. Each block id becomes the same 16 random tokens
wherever it appears, so equal ids make equal prefixes.

For each: the prefix cache hit rate and prompt tokens computed (from the workers' pdserve:prefix_cache_*
counters, before and after), TTFT p50 / p90, errors. Writes results.json, table.md and prefix_routing.png
under --out.

    .venv/bin/python benchmarks/prefix_routing.py [--trace FILE] [--conversations 30] [--out DIR]

The trace is not in this repository; fetch it once:
    curl -Lo ~/.cache/pdserve/traces/mooncake_conversation_trace.jsonl \\
      https://raw.githubusercontent.com/kvcache-ai/Mooncake/main/FAST25-release/traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_vs_colocated import served
from loadgen.client import RequestRecord, send_one
from loadgen.summary import percentile
from loadgen.workload import RequestSpec

TRACE = Path.home() / ".cache" / "pdserve" / "traces" / "mooncake_conversation_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
VOCAB = 49152
SETUPS = {"prefix-aware": "prefix", "least-loaded": "load"}


def sample_conversations(rows: list[dict[str, Any]], num: int, seed: int) -> list[dict[str, Any]]:
    """Every request of `num` conversations chosen at random (a conversation: the requests whose first block
    after the shared system block is the same), in arrival order."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        ids = row["hash_ids"]
        if len(ids) >= 2:
            groups.setdefault(ids[1], []).append(row)
    multi = [key for key, turns in groups.items() if len(turns) >= 2]  # conversations of several turns
    chosen = random.Random(seed).sample(multi, min(num, len(multi)))
    return sorted((row for key in chosen for row in groups[key]), key=lambda r: r["timestamp"])


def build_specs(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[RequestSpec]:
    block_tokens = max(1, round(TRACE_BLOCK_TOKENS * args.length_scale))
    blocks: dict[int, tuple[int, ...]] = {}

    def block(block_id: int) -> tuple[int, ...]:
        if block_id not in blocks:
            rng = random.Random(block_id)
            blocks[block_id] = tuple(rng.randrange(VOCAB) for _ in range(block_tokens))
        return blocks[block_id]

    first, last = rows[0]["timestamp"], rows[-1]["timestamp"]
    squeeze = args.duration_s / max(1.0, (last - first) / 1000.0)
    specs = []
    for index, row in enumerate(rows):
        length = max(1, round(row["input_length"] * args.length_scale))
        prompt = tuple(t for block_id in row["hash_ids"] for t in block(block_id))[:length]
        output = max(1, min(args.max_output, round(row["output_length"] * args.length_scale)))
        specs.append(RequestSpec(index, (row["timestamp"] - first) / 1000.0 * squeeze, prompt, output))
    return specs


def prefix_counters(url: str) -> tuple[float, float]:
    """The workers' prefix cache queries and hits so far, in prompt tokens, summed."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    sums = {}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
        values = re.findall(rf"^pdserve:{name}{{[^}}]*}} ([0-9.e+]+)$", text, re.MULTILINE)
        sums[name] = sum(float(v) for v in values)
    return sums["prefix_cache_queries_total"], sums["prefix_cache_hits_total"]


async def replay(url: str, specs: list[RequestSpec], model: str) -> list[RequestRecord]:
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        return list(await asyncio.gather(*(send_one(client, s, model, start) for s in specs)))


def run_setup(routing: str, specs: list[RequestSpec], args: argparse.Namespace) -> dict[str, Any]:
    # Three workers on a 2-core machine: each asks Ray for 0.6 of a CPU (one each would leave one pending).
    flags = ["--prefill", "2", "--decode", "1", "--backend", "nixl", "--prefill-routing", routing,
             "--cpus-per-worker", "0.6"]
    with served(flags) as url:
        queries0, hits0 = prefix_counters(url)
        began = time.perf_counter()
        records = asyncio.run(replay(url, specs, "SmolLM2-135M-Instruct"))
        seconds = time.perf_counter() - began
        queries1, hits1 = prefix_counters(url)
    queries, hits = queries1 - queries0, hits1 - hits0
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None and not r.error]
    return {"requests": len(records), "errors": sum(bool(r.error) for r in records),
            "hit_rate": hits / queries if queries else float("nan"), "prompt_tokens": queries,
            "prompt_tokens_computed": queries - hits, "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p90_s": percentile(ttfts, 90), "seconds": seconds}


def plot(results: dict[str, dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    panels = [("hit_rate", "prefix cache hit rate"), ("prompt_tokens_computed", "prompt tokens computed"),
              ("ttft_p50_s", "TTFT p50, s"), ("ttft_p90_s", "TTFT p90, s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.0 * len(panels), 2.8))
    for axis, (key, title) in zip(axes, panels, strict=True):
        axis.bar(names, [results[n][key] for n in names], color=["tab:blue", "tab:gray"][:len(names)])
        axis.set_title(title, fontsize=9)
        axis.tick_params(labelsize=8)
    fig.tight_layout()
    fig.savefig(out / "prefix_routing.png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--conversations", type=int, default=30)
    parser.add_argument("--duration-s", type=float, default=180.0, help="the sample's arrivals, compressed")
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/prefix_routing"))
    args = parser.parse_args()
    if not args.trace.is_file():
        raise SystemExit(f"--trace: no file {args.trace}; see this script's docstring for where to get it")
    rows = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    specs = build_specs(sample_conversations(rows, args.conversations, args.seed), args)
    print(f"{len(specs)} requests of {args.conversations} conversations over {args.duration_s:g} s; prompts "
          f"mean {sum(len(s.prompt_token_ids) for s in specs) / len(specs):.0f} tokens", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, routing in SETUPS.items():
        results[name] = run_setup(routing, specs, args)
        print(f"{name}: {results[name]}", flush=True)
    (args.out / "results.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    lines = ["| routing | requests (errors) | prefix hit rate | prompt tokens computed | TTFT p50 | TTFT p90 "
             "|",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['requests']} ({r['errors']}) | {r['hit_rate']:.1%} | "
                     f"{r['prompt_tokens_computed']:.0f} of {r['prompt_tokens']:.0f} | "
                     f"{r['ttft_p50_s']:.2f} s | {r['ttft_p90_s']:.2f} s |")
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, args.out)


if __name__ == "__main__":
    main()
