"""Every long gap in a stream, and what its worker says it was (not a test; issue 49: a gap in a stream over
ten times its worker's median step needs a cause the worker can name).

The interference workload of benchmarks/vs_vllm.py (4 streams 256 in / 128 out alone, then again with two
1500-token prompts arriving while they stream), --rounds times on one `pdserve serve` (1P+1D, bfloat16 unless
--pdserve-args say otherwise). After each round, every decoding worker's forwards in the round's window
(GET /admin/workers/{id}/steps): their median; each stream gap over --factor × that median is matched to the
forward that ran longest during it, and reported with that forward's duration and `slow_cause`
(llm_engine/step_causes.py: a compile, a collection, or neither) when that one forward covers half of it;
else, when the worker's forwards of its usual length cover most of it, the worker made the tokens and they
were held on their way out (the output channel, the gateway, the client); else the worker waited.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gap_causes.py [--rounds 5] [--factor 10]
        [--pdserve-args "--dtype bfloat16"] [--out benchmarks/results/gap_causes]
Writes OUT.md (a table a round, then every long gap) and OUT.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.vs_vllm import (
    PDSERVE,
    Load,
    Prompts,
    cpu_description,
    free_port,
    interference_round,
    pdserve_server,
)
from loadgen.client import RequestRecord, send_one
from loadgen.summary import percentile


@dataclass(frozen=True)
class Gap:
    start: float  # time.time() of the token before it
    seconds: float
    worker_id: str  # the decoding worker whose forward covered most of it ("" if none)
    step_ms: float  # that forward's duration
    cause: str  # its slow_cause, or why there is none


def stream_gaps(records: list[RequestRecord], started: float) -> list[tuple[float, float]]:
    """(start, length) of every gap between two tokens of the streams, in Unix time."""
    gaps = []
    for r in records:
        times = [started + r.sent_s + t for t in r.token_times_s]
        gaps += [(a, b - a) for a, b in itertools.pairwise(times)]
    return gaps


def explain(start: float, seconds: float, steps: dict[str, list[dict[str, Any]]],
            medians: dict[str, float]) -> Gap:
    """What each decoding worker did within [start, start + seconds]: one long forward (and what the worker
    said of it), forwards of its usual length one after another (the tokens were made, then held on their
    way to the client), or no forward (the worker waited)."""
    best: tuple[float, str, dict[str, Any]] | None = None
    covered: dict[str, tuple[float, int]] = {}  # per worker: seconds of the gap under its forwards, how many
    for worker_id, worker_steps in steps.items():
        for step in worker_steps:
            begin, end = step["started"], step["started"] + step["duration_ms"] / 1000
            overlap = min(end, start + seconds) - max(begin, start)
            if overlap <= 0:
                continue
            seconds_so_far, count = covered.get(worker_id, (0.0, 0))
            covered[worker_id] = (seconds_so_far + overlap, count + 1)
            if best is None or overlap > best[0]:
                best = (overlap, worker_id, step)
    if best is None:
        return Gap(start, seconds, "", 0.0, "no forward ran: the worker waited")
    _, worker_id, step = best
    if best[0] >= seconds / 2:
        cause = step.get("slow_cause") or (f"a forward of {step['duration_ms']:.0f} ms, under the worker's "
                                           f"own slow mark (median {medians[worker_id]:.1f} ms)")
        return Gap(start, seconds, worker_id, step["duration_ms"], cause)
    busy, count = covered[worker_id]
    if busy >= seconds / 2:
        return Gap(start, seconds, worker_id, step["duration_ms"],
                   f"the worker kept stepping ({count} forwards, {busy / seconds:.0%} of the gap): its "
                   "tokens were made and held on their way out (output channel → gateway → client)")
    return Gap(start, seconds, worker_id, step["duration_ms"],
               f"the worker mostly waited ({count} forwards, {busy / seconds:.0%} of the gap)")


async def decoding_steps(client: httpx.AsyncClient, since: float) -> dict[str, list[dict[str, Any]]]:
    """Each decode or mixed worker's forwards since `since` (Unix time)."""
    pools = (await client.get("/admin/pools")).json()
    return {w["worker_id"]: (await client.get(f"/admin/workers/{w['worker_id']}/steps",
                                              params={"since": since})).json()["steps"]
            for w in pools["workers"] if w["role"] in ("decode", "mixed")}


async def run(url: str, model: str, load: Load, vocab_size: int, rounds: int, factor: float
              ) -> list[dict[str, Any]]:
    prompts = Prompts(vocab_size, seed=0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        now = time.perf_counter()  # send_one's clock
        warmup = [prompts.spec(load.single_in, 16) for _ in range(2)]
        await asyncio.gather(*(send_one(client, s, model, now) for s in warmup))
        for index in range(rounds):
            done = await interference_round(client, model, load, prompts)
            steps = await decoding_steps(client, done.started)
            medians = {w: statistics.median(s["duration_ms"] for s in ss) for w, ss in steps.items() if ss}
            gaps = stream_gaps(done.streams, done.started)
            median_step_s = min(medians.values()) / 1000
            long_gaps = [explain(start, length, steps, medians) for start, length in gaps
                         if length > factor * median_step_s]
            lengths = [length for _, length in gaps]
            results.append({
                "round": index + 1, "median_step_ms": {w: round(m, 2) for w, m in medians.items()},
                "itl_ms_p50": 1000 * percentile(lengths, 50), "itl_ms_p99": 1000 * percentile(lengths, 99),
                "itl_ms_max": 1000 * max(lengths), "num_gaps": len(lengths),
                "long_gaps": [{"ms": round(1000 * g.seconds, 1), "worker": g.worker_id,
                               "step_ms": round(g.step_ms, 1), "cause": g.cause} for g in long_gaps],
            })
            print(json.dumps(results[-1]), flush=True)
    return results


def write_report(out: Path, results: list[dict[str, Any]], command: str, factor: float) -> None:
    lines = [f"# Long gaps in streams and their causes ({command})", "", f"CPU: {cpu_description()}", "",
             f"| round | decode median step ms | streams' ITL p50 / p99 / max ms | gaps over {factor:g}× the "
             "median step |", "|---:|---:|---:|---:|"]
    for r in results:
        median = " / ".join(f"{m:.1f}" for m in r["median_step_ms"].values())
        lines.append(f"| {r['round']} | {median} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} / "
                     f"{r['itl_ms_max']:.1f} | {len(r['long_gaps'])} of {r['num_gaps']} |")
    lines += ["", "| round | gap ms | worker | its longest forward ms | cause |", "|---:|---:|---|---:|---|"]
    for r in results:
        lines += [f"| {r['round']} | {g['ms']} | {g['worker'] or '—'} | {g['step_ms']} | {g['cause']} |"
                  for g in r["long_gaps"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--factor", type=float, default=10.0)
    parser.add_argument("--layout", default="--prefill 1 --decode 1")
    parser.add_argument("--pdserve-args", default="--dtype bfloat16")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gap_causes"))
    parser.add_argument("--log", type=Path, default=Path("/tmp/gap_causes.log"))
    args = parser.parse_args()
    from llm_engine.default_model import prepare_default_model

    model_dir = prepare_default_model()
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    command = [str(PDSERVE), "serve", "--model", str(model_dir), *shlex.split(args.layout),
               *shlex.split(args.pdserve_args), "--port", str(free_port())]
    with pdserve_server(command, args.log) as url:
        results = asyncio.run(run(url, model_dir.name, Load(), vocab_size, args.rounds, args.factor))
    write_report(args.out, results, " ".join(["pdserve serve", args.layout, args.pdserve_args]), args.factor)


if __name__ == "__main__":
    main()
