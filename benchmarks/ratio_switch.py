"""Fixed layouts against the ratio controller (not a test): 1P+1D, 2 mixed and `--ratio auto`, same loads.

On this 2-core machine with SmolLM2-135M (one torch thread per worker), each setup is a real `pdserve serve`
(as in pd_vs_colocated.py) driven by three loads, one after another:
  phased   Azure-conversation-shaped chat (lengths × 0.25, Poisson) for three phases; in the middle one,
           long prompts (1500 tokens) arrive too. ITL p99, TTFT p90 and goodput per phase and overall; for
           auto, a timeline of roles against queued prompt tokens (timeline.png) and its decisions.
  closed16 16 clients, each sending 256-token prompts for 64 tokens, back to back: output tokens/s.
  burst    4 streams (256 prompt, 128 out) decoding when two 1500-token prompts arrive: the streams' ITL p99.
  alone    the same 4 streams with nothing else: their ITL p99 (the mixed path's own tails).
"auto+plan" is auto with --profile (the controller's planner):
benchmarks/profiles/smollm2-135m-bf16-xeon.json, `pdserve tune profile`'s bf16 profile of this machine kind
(2026-12-01), so run with the default dtype.
With --base DIR (a worktree of an earlier commit), "auto @base" runs `--ratio auto` from that checkout too,
so that a change to the controller or to role changes is measured side by side.
Writes results.json, table.md and the plots under --out.

    .venv/bin/python benchmarks/ratio_switch.py [--phase-s 40] [--base /tmp/base] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from benchmarks.pd_vs_colocated import TRACE, start_server
from benchmarks.ratiolib.report import write_medians, write_report
from loadgen.client import RequestRecord, send_one
from loadgen.summary import SLO, percentile, summarize
from loadgen.workload import RequestSpec, build_requests, poisson_arrivals, read_trace

SETUPS = {
    "1P+1D": ["--prefill", "1", "--decode", "1", "--backend", "nixl"],
    "2 mixed": ["--mixed", "2", "--backend", "nixl"],
    "auto": ["--mixed", "2", "--backend", "nixl", "--ratio", "auto"],
    "auto+plan": ["--mixed", "2", "--backend", "nixl", "--ratio", "auto", "--profile",
                  "benchmarks/profiles/smollm2-135m-bf16-xeon.json"],
}
# With --workers 4 (a small model, --model, so that four workers fit two cores): the comparison.
SETUPS4 = {
    "2P+2D": ["--prefill", "2", "--decode", "2", "--backend", "nixl"],
    "1P+3D": ["--prefill", "1", "--decode", "3", "--backend", "nixl"],
    "4 mixed": ["--mixed", "4", "--backend", "nixl"],
    "auto": ["--mixed", "4", "--backend", "nixl", "--ratio", "auto"],
}
VOCAB = 49152
PHASES = ("light", "long prompts", "light again")


def phased_load(args: argparse.Namespace) -> list[RequestSpec]:
    """Chat traffic over three phases, plus long prompts in the middle one; arrival order, indexed."""
    total = 3 * args.phase_s
    chat = build_requests(100_000, VOCAB, seed=1, rate=args.chat_rate, trace=read_trace(TRACE),
                          length_scale=0.25, duration_s=total)
    rng = random.Random(2)
    long_arrivals = [args.phase_s + t for t in poisson_arrivals(args.long_rate, 1000, rng)
                     if t < args.phase_s]
    long = [RequestSpec(0, t, tuple(rng.randrange(VOCAB) for _ in range(args.long_len)), 32)
            for t in long_arrivals]
    merged = sorted(chat + long, key=lambda spec: spec.arrival_s)
    return [RequestSpec(i, s.arrival_s, s.prompt_token_ids, s.output_len) for i, s in enumerate(merged)]


async def sample_pools(client: httpx.AsyncClient, start: float, stop: asyncio.Event,
                       timeline: list[dict[str, object]]) -> None:
    while not stop.is_set():
        pools = (await client.get("/admin/pools")).json()
        timeline.append({"t": time.perf_counter() - start, "prefill": pools["prefill"],
                         "decode": pools["decode"], "mixed": pools["mixed"],
                         "queued_prompt_tokens": pools["queued_prompt_tokens"],
                         "changing": sum(w["state"] == "changing_role" for w in pools["workers"])})
        await asyncio.sleep(0.5)


async def drive(url: str, specs: list[RequestSpec], clients: int = 0
                ) -> tuple[list[RequestRecord], list[dict[str, object]], list[dict[str, object]]]:
    """Send the specs open-loop at their arrival times (clients=0), or closed-loop by `clients` clients
    sending back to back; returns the records, the pool timeline and the controller's decisions."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        stop, timeline = asyncio.Event(), []
        start, wall_start = time.perf_counter(), time.time()
        sampler = asyncio.ensure_future(sample_pools(client, start, stop, timeline))
        if clients:
            async def one_client(mine: list[RequestSpec]) -> list[RequestRecord]:
                return [await send_one(client, spec, model, time.perf_counter() - spec.arrival_s)
                        for spec in mine]
            per_client = await asyncio.gather(*(one_client(specs[c::clients]) for c in range(clients)))
            records = [r for rs in per_client for r in rs]
        else:
            records = list(await asyncio.gather(*(send_one(client, s, model, start) for s in specs)))
        stop.set()
        await sampler
        decisions = [d for d in (await client.get("/admin/pools")).json()["ratio_decisions"]
                     if d["at"] >= wall_start]
    records.sort(key=lambda r: r.index)
    return records, timeline, decisions


def closed16_load() -> list[RequestSpec]:
    rng = random.Random(3)
    return [RequestSpec(i, 0.0, tuple(rng.randrange(VOCAB) for _ in range(256)), 64) for i in range(32)]


def burst_load() -> list[RequestSpec]:
    rng = random.Random(4)
    streams = [RequestSpec(i, 0.0, tuple(rng.randrange(VOCAB) for _ in range(256)), 128) for i in range(4)]
    long = [RequestSpec(4 + i, 3.0 + 0.5 * i, tuple(rng.randrange(VOCAB) for _ in range(1500)), 16)
            for i in range(2)]
    return streams + long


async def wait_for_layout(url: str, layout: tuple[int, int, int], timeout_s: float = 120.0) -> None:
    """Before each load: the setup's own starting layout (auto goes back to 2 mixed once calm)."""
    async with httpx.AsyncClient(base_url=url) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pools = (await client.get("/admin/pools")).json()
            is_there = (pools["prefill"], pools["decode"], pools["mixed"]) == layout
            if is_there and not pools["change_in_progress"]:
                return
            await asyncio.sleep(0.5)
    raise SystemExit(f"{url} did not return to {layout}")


def starting_layout(flags: list[str]) -> tuple[int, int, int]:
    """(prefill, decode, mixed) as the setup's flags start it (auto goes back there once calm)."""
    def count(flag: str) -> int:
        return int(flags[flags.index(flag) + 1]) if flag in flags else 0
    return count("--prefill"), count("--decode"), count("--mixed")


def run_setup(name: str, flags: list[str], args: argparse.Namespace, code_dir: Path | None = None
              ) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    start_layout = starting_layout(flags)
    slo_flags = ["--ttft-slo-s", str(args.ttft_slo), "--itl-slo-s", str(args.itl_slo)]
    model_flags = [*(["--model", args.model] if args.model else []), *(["--dtype", args.dtype] if args.dtype
                                                                       else [])]
    if args.workers == 4:  # four workers on a machine's cores: Ray must place them (each a share of one)
        model_flags += ["--cpus-per-worker", "0.5"]
    server = start_server([*flags, *slo_flags, *model_flags], port, code_dir)
    slo = SLO(args.ttft_slo, args.itl_slo)
    result: dict[str, object] = {}
    try:
        asyncio.run(wait_for_layout(url, start_layout))
        records, timeline, decisions = asyncio.run(drive(url, phased_load(args)))
        phases = {}
        for i, phase in enumerate(PHASES):
            mine = [r for r in records if i * args.phase_s <= r.scheduled_s < (i + 1) * args.phase_s]
            phases[phase] = summarize(mine, slo)
        result["phased"] = {"phases": phases, "overall": summarize(records, slo), "timeline": timeline,
                            "decisions": decisions, "records": [asdict(r) for r in records]}
        print(name, "phased", {p: round(s["goodput"], 2) for p, s in phases.items()}, flush=True)

        asyncio.run(wait_for_layout(url, start_layout))
        records, timeline, decisions = asyncio.run(drive(url, closed16_load(), clients=16))
        result["closed16"] = {**summarize(records, slo), "timeline": timeline, "decisions": decisions}
        print(name, "closed16 tok/s", round(result["closed16"]["output_token_throughput"], 1), flush=True)

        asyncio.run(wait_for_layout(url, start_layout))
        records, timeline, decisions = asyncio.run(drive(url, burst_load()))
        stream_gaps = [gap for r in records[:4] for gap in r.itls_s]
        result["burst"] = {**summarize(records, slo), "stream_itl_p99_s": percentile(stream_gaps, 99),
                           "stream_itl_max_s": max(stream_gaps, default=float("nan")),
                           "timeline": timeline, "decisions": decisions}
        print(name, "burst stream ITL p99 ms", round(1000 * result["burst"]["stream_itl_p99_s"]), flush=True)

        asyncio.run(wait_for_layout(url, start_layout))
        records, timeline, decisions = asyncio.run(drive(url, burst_load()[:4]))
        stream_gaps = [gap for r in records for gap in r.itls_s]
        result["alone"] = {**summarize(records, slo), "stream_itl_p99_s": percentile(stream_gaps, 99),
                           "stream_itl_max_s": max(stream_gaps, default=float("nan")),
                           "timeline": timeline, "decisions": decisions}
        print(name, "alone stream ITL p99 ms", round(1000 * result["alone"]["stream_itl_p99_s"]), flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(120)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase-s", type=float, default=40.0, help="seconds of arrivals per phase")
    parser.add_argument("--chat-rate", type=float, default=0.3, help="chat requests/s in every phase")
    parser.add_argument("--long-rate", type=float, default=0.15, help="long prompts/s in the middle phase")
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--itl-slo", type=float, default=0.2)
    parser.add_argument("--setups", nargs="+", help="default: every setup of the --workers set")
    parser.add_argument("--workers", type=int, choices=(2, 4), default=2,
                        help="2: 1P+1D, 2 mixed, auto (+planner); 4: 2P+2D, 1P+3D, 4 mixed, auto")
    parser.add_argument("--model", help="a model directory (--workers 4 needs a small one to fit)")
    parser.add_argument("--dtype", help="the servers' --dtype (default: theirs)")
    parser.add_argument("--base", type=Path, help="also run --base-setups from this checkout (an earlier "
                        "commit), as 'NAME @base'")
    parser.add_argument("--base-setups", nargs="+", default=["auto"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds of every setup; medians.md over them")
    parser.add_argument("--out", default="benchmarks/results/ratio_switch")
    args = parser.parse_args()
    setups = SETUPS4 if args.workers == 4 else SETUPS
    unknown = (set(args.setups or ()) | set(args.base_setups)) - set(setups)
    if unknown:
        parser.error(f"--setups/--base-setups: {sorted(unknown)} not in the --workers {args.workers} set "
                     f"{list(setups)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for _ in range(args.repeats):
        results = {name: run_setup(name, setups[name], args) for name in args.setups or setups}
        for name in args.base_setups if args.base else []:
            results[f"{name} @base"] = run_setup(f"{name} @base", setups[name], args, args.base.resolve())
        rounds.append(results)
        report = {"args": vars(args), "results": rounds[0], "rounds": rounds}
        (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    write_report(rounds[0], args, out)
    write_medians(rounds, args, out)


if __name__ == "__main__":
    main()
