"""(Over 300 lines: one script a user runs; both servers' start, warm-up and workloads in one place.)

pdserve beside vLLM's CPU server, one run, one client, the same requests (issue 18; not a test).

Each server in turn (`--servers`): vLLM's OpenAI server (benchmarks/vllm_baseline.py: its venv, bf16, its
worker's one OpenMP thread bound to core 0, --vllm-threads), `pdserve serve --prefill 1 --decode 1`, and
`pdserve serve --mixed 2 --ratio auto` (both with --pdserve-args appended), started, warmed up, then driven
by loadgen's streaming client (loadgen/client.py send_one: /v1/completions, prompt as token ids,
ignore_eos, temperature 0):
  (a) single: one request 256 in / 64 out at a time, --single-repeats times: TTFT and TPOT medians;
  (b) concurrent: --concurrency clients in a closed loop, --rounds requests each, 256 in / 64 out:
      output tokens/s over the whole load and TTFT p90;
  (c) interference: 4 streams 256 in / 128 out alone (their ITL p99 and max), then again with two
      1500-token prompts (max_tokens 8) arriving once all four stream: the streams' ITL p99 and max.
      "Once all four stream" is the alone round's slowest TTFT + --long-delay-s after the streams leave;
      the report checks that every stream had its first token by then and was still running.
Every prompt is fresh random token ids (no prefix-cache hits on either server). Writes a markdown table with
the CPU's model and flags to --out (.md) and every figure beside it (.json); server logs go to --log-dir.

    .venv/bin/python benchmarks/vs_vllm.py [--servers vllm pd mixed] [--pdserve-args "--dtype bfloat16"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.server_ready import wait_compiled
from benchmarks.vllm_baseline import VllmServerConfig, stop_process_tree, vllm_server, wait_healthy
from loadgen.client import RequestRecord, send_one
from loadgen.summary import percentile
from loadgen.workload import RequestSpec

PDSERVE = Path(sys.executable).with_name("pdserve")
PDSERVE_LAYOUTS = {
    "pd": ("pdserve 1P+1D", ("--prefill", "1", "--decode", "1")),
    "mixed": ("pdserve 2 mixed, ratio auto", ("--mixed", "2", "--ratio", "auto")),
}
# A "-2t" variant runs the same server with two threads per engine (pdserve: --threads-per-worker 2, so both
# workers share both cores; vLLM: its worker bound to cores 0-1), to compare against one thread each.
SERVER_NAMES = ("vllm", *PDSERVE_LAYOUTS, "vllm-2t", *(f"{name}-2t" for name in PDSERVE_LAYOUTS))
CPU_FLAGS_SHOWN = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",
                   "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
MIN_TOKEN_ID = 100  # random prompts skip the low ids, where SmolLM2 keeps its special tokens


@dataclass(frozen=True)
class Load:
    """The three loads (see the module docstring); every length is in tokens."""

    single_in: int = 256
    single_out: int = 64
    single_repeats: int = 5
    concurrency: int = 16
    rounds: int = 3
    stream_count: int = 4
    stream_in: int = 256
    stream_out: int = 128
    long_count: int = 2
    long_in: int = 1500
    long_out: int = 8
    long_delay_s: float = 1.0  # after the slowest stream's first token
    interference_rounds: int = 3  # (c) runs this many times on each server: median and spread reported


class Prompts:
    """Fresh random prompts: no two share a prefix, so no server finds one in its prefix cache."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._rng = random.Random(seed)
        self._vocab_size = vocab_size
        self._count = 0

    def spec(self, length: int, output_len: int, arrival_s: float = 0.0) -> RequestSpec:
        self._count += 1
        ids = tuple(self._rng.randrange(MIN_TOKEN_ID, self._vocab_size) for _ in range(length))
        return RequestSpec(self._count, arrival_s, ids, output_len)


def _checked(records: list[RequestRecord], what: str) -> list[RequestRecord]:
    failed = [r for r in records if r.error or r.ttft_s is None]
    if failed:
        example = failed[0]
        raise RuntimeError(f"{what}: {len(failed)} requests failed, e.g. {example.status} {example.error}")
    return records


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


async def run_single(client: httpx.AsyncClient, model: str, load: Load, prompts: Prompts) -> dict[str, Any]:
    records = []
    for _ in range(load.single_repeats):
        spec = prompts.spec(load.single_in, load.single_out)
        records.append(await send_one(client, spec, model, time.perf_counter()))
    _checked(records, "single")
    return {
        "ttft_ms_p50": _ms(statistics.median(r.ttft_s for r in records if r.ttft_s is not None)),
        "tpot_ms_p50": _ms(statistics.median(r.tpot_s for r in records if r.tpot_s is not None)),
        "ttft_ms": [_ms(r.ttft_s) for r in records if r.ttft_s is not None],
        "tpot_ms": [_ms(r.tpot_s) for r in records if r.tpot_s is not None],
    }


async def run_concurrent(client: httpx.AsyncClient, model: str, load: Load, prompts: Prompts
                         ) -> dict[str, Any]:
    async def one_client() -> list[RequestRecord]:
        done = []
        for _ in range(load.rounds):  # closed loop: the next request leaves when the last one ended
            spec = prompts.spec(load.single_in, load.single_out)
            done.append(await send_one(client, spec, model, time.perf_counter()))
        return done

    start = time.perf_counter()
    per_client = await asyncio.gather(*(one_client() for _ in range(load.concurrency)))
    elapsed = time.perf_counter() - start
    records = _checked([r for rs in per_client for r in rs], "concurrent")
    ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
    return {
        "output_tok_per_s": round(sum(r.num_output_tokens for r in records) / elapsed, 1),
        "ttft_ms_p90": _ms(percentile(ttfts, 90)),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "num_requests": len(records),
        "elapsed_s": round(elapsed, 2),
    }


def _gaps(records: list[RequestRecord]) -> list[float]:
    return [gap for r in records for gap in r.itls_s]


@dataclass
class InterferenceRound:
    """One round of (c): the streams alone, then with the long prompts (records relative to `started`)."""

    alone: list[RequestRecord]
    streams: list[RequestRecord]
    longs: list[RequestRecord]
    long_at_s: float  # when the long prompts were sent, after `started`
    started: float  # time.time() of the second part's start: its records' sent_s count from here


async def interference_round(client: httpx.AsyncClient, model: str, load: Load, prompts: Prompts
                             ) -> InterferenceRound:
    start = time.perf_counter()
    alone = _checked(await asyncio.gather(*(
        send_one(client, prompts.spec(load.stream_in, load.stream_out), model, start)
        for _ in range(load.stream_count)
    )), "streams alone")
    long_at_s = max(r.ttft_s for r in alone if r.ttft_s is not None) + load.long_delay_s
    start = time.perf_counter()  # send_one sends each request at start + its arrival_s (perf_counter clock)
    started = time.time()
    specs = [prompts.spec(load.stream_in, load.stream_out) for _ in range(load.stream_count)]
    longs = [prompts.spec(load.long_in, load.long_out, long_at_s) for _ in range(load.long_count)]
    records = _checked(
        await asyncio.gather(*(send_one(client, spec, model, start) for spec in [*specs, *longs])),
        "streams with long prompts",
    )
    return InterferenceRound(alone, records[: load.stream_count], records[load.stream_count :], long_at_s,
                             started)


async def run_interference(client: httpx.AsyncClient, model: str, load: Load, prompts: Prompts
                           ) -> dict[str, Any]:
    done = await interference_round(client, model, load, prompts)
    alone, streams, long_records, long_at_s = done.alone, done.streams, done.longs, done.long_at_s
    # Were all four streaming when the long prompts arrived (first token before, last token after)?
    all_streaming = all(
        r.ttft_s is not None and r.e2e_s is not None and r.sent_s + r.ttft_s <= long_at_s < r.sent_s + r.e2e_s
        for r in streams
    )
    gaps_alone, gaps_with = _gaps(alone), _gaps(streams)
    return {
        "itl_ms_p99_alone": _ms(percentile(gaps_alone, 99)),
        "itl_ms_max_alone": _ms(max(gaps_alone)),
        "itl_ms_p50_alone": _ms(percentile(gaps_alone, 50)),
        "itl_ms_p99": _ms(percentile(gaps_with, 99)),
        "itl_ms_max": _ms(max(gaps_with)),
        "itl_ms_p50": _ms(percentile(gaps_with, 50)),
        "long_at_s": round(long_at_s, 3),
        "all_streaming_at_long_arrival": all_streaming,
        "long_ttft_ms": [_ms(r.ttft_s) for r in long_records if r.ttft_s is not None],
    }


async def measure(url: str, model: str, load: Load, vocab_size: int, seed: int) -> dict[str, Any]:
    prompts = Prompts(vocab_size, seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        warmup = [prompts.spec(load.single_in, 16) for _ in range(2)]  # first requests pay one-off costs
        now = time.perf_counter()
        _checked(await asyncio.gather(*(send_one(client, s, model, now) for s in warmup)), "warm-up")
        single = await run_single(client, model, load, prompts)
        concurrent = await run_concurrent(client, model, load, prompts)
        rounds = [await run_interference(client, model, load, prompts)
                  for _ in range(load.interference_rounds)]
        return {"single": single, "concurrent": concurrent, "interference": summarize_rounds(rounds)}


def summarize_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of (c) as one result: each figure's median, its [min, max] under `<key>_range`, whether
    every round had all streams running when the long prompts came, and each round's figures as they were."""
    summary: dict[str, Any] = {"rounds": rounds}
    for key in ("itl_ms_p99_alone", "itl_ms_max_alone", "itl_ms_p50_alone", "itl_ms_p99", "itl_ms_max",
                "itl_ms_p50"):
        values = [r[key] for r in rounds]
        summary[key], summary[key + "_range"] = statistics.median(values), [min(values), max(values)]
    summary["all_streaming_at_long_arrival"] = all(r["all_streaming_at_long_arrival"] for r in rounds)
    summary["long_ttft_ms"] = [t for r in rounds for t in r["long_ttft_ms"]]
    return summary


def _spread(c: dict[str, Any], key: str) -> str:
    low, high = c.get(key + "_range", [c[key], c[key]])
    return f"{c[key]:.0f} [{low:.0f}–{high:.0f}]"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def pdserve_server(command: list[str], log_path: Path) -> Iterator[str]:
    """`pdserve serve` (its command ends with `--port P`), healthy; yields its URL. At the end: SIGINT (it
    shuts its local Ray down), then SIGKILL to its process group and every process it started, by pid."""
    port = command[command.index("--port") + 1]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, env={**os.environ, "UCX_NET_DEVICES": "lo"}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(process, url, 300.0, "pdserve serve")
            wait_compiled(url)  # its workers at their steady speed
            yield url
        finally:
            stop_process_tree(process, signal.SIGINT, grace_s=60.0)


def cpu_description() -> str:
    first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    pairs = (line.partition(":") for line in first_cpu.splitlines())
    fields = {key.strip(): value.strip() for key, _, value in pairs}
    flags = set(fields.get("flags", "").split())
    shown = " ".join(flag for flag in CPU_FLAGS_SHOWN if flag in flags) or "none of those sought"
    return f"{fields.get('model name', 'unknown CPU')}, {os.cpu_count()} cores; flags: {shown}"


def write_report(results: dict[str, dict[str, Any]], args: argparse.Namespace, load: Load) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# pdserve beside vLLM's CPU server ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"Machine: {cpu_description()}. Model: `{Path(args.model).name}`. One client (loadgen's "
        "streaming /v1/completions, prompts of fresh random token ids, ignore_eos, temperature 0), each "
        "server in turn.",
        f"Command: `.venv/bin/python benchmarks/vs_vllm.py {' '.join(map(shlex.quote, sys.argv[1:]))}`",
        "",
        f"(a) one request at a time, {load.single_in} in / {load.single_out} out, ×{load.single_repeats}: "
        f"medians. (b) {load.concurrency} clients, closed loop, {load.rounds} requests each, "
        f"{load.single_in} in / {load.single_out} out. (c) {load.stream_count} streams {load.stream_in} in / "
        f"{load.stream_out} out, alone, then with {load.long_count} × {load.long_in}-token prompts "
        f"(max_tokens {load.long_out}) arriving {load.long_delay_s} s after the streams' slowest first "
        f"token: the streams' inter-token gaps, {load.interference_rounds} rounds on each server, median "
        "[min–max] of the rounds; the long prompts' TTFT of every round.",
        "",
        "| server | (a) TTFT ms | (a) TPOT ms | (b) out tok/s | (b) TTFT p90 ms | (c) ITL p99 / max ms alone "
        "| (c) ITL p99 / max ms with long prompts | (c) long prompts' TTFT ms | all streaming? |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results.values():
        a, b, c = result["single"], result["concurrent"], result["interference"]
        lines.append(
            f"| {result['label']} | {a['ttft_ms_p50']:.0f} | {a['tpot_ms_p50']:.1f} | "
            f"{b['output_tok_per_s']:.0f} | {b['ttft_ms_p90']:.0f} | "
            f"{_spread(c, 'itl_ms_p99_alone')} / {_spread(c, 'itl_ms_max_alone')} | "
            f"{_spread(c, 'itl_ms_p99')} / {_spread(c, 'itl_ms_max')} | "
            f"{', '.join(f'{t:.0f}' for t in c['long_ttft_ms'])} | "
            f"{'yes' if c['all_streaming_at_long_arrival'] else 'no'} |"
        )
    lines += ["", "Settings:"]
    lines += [f"- {result['label']}: `{result['settings']}`" for result in results.values()]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(
        {"cpu": cpu_description(), "load": asdict(load), "argv": sys.argv[1:], "servers": results}, indent=2
    ))
    print("\n".join(lines), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="model directory (default: pdserve's default model)")
    parser.add_argument("--servers", nargs="+", choices=SERVER_NAMES, default=list(SERVER_NAMES))
    parser.add_argument("--pdserve-args", default="", help="flags appended to every `pdserve serve`")
    parser.add_argument("--vllm-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    # 1: its worker on core 0 leaves core 1 to its API server and engine-core processes; with both cores bound
    # (0-1) those interrupt the OpenMP team and TPOT was 2-3x worse here (2026-12-01, a busy machine).
    parser.add_argument("--vllm-threads", type=int, choices=(1, 2), default=1)
    parser.add_argument("--vllm-args", default="", help="flags appended to vLLM's api_server")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    for field, default in asdict(Load()).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/vs_vllm", help="writes OUT.md and OUT.json")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/vs_vllm_logs"))
    args = parser.parse_args()
    if args.model is None:
        from llm_engine.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    model_dir = Path(args.model).resolve()
    vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    load = Load(**{field: getattr(args, field) for field in asdict(Load())})
    args.log_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for name in args.servers:
        port = free_port()
        log_path = args.log_dir / f"{name}.log"
        base, two_threads = name.removesuffix("-2t"), name.endswith("-2t")
        if base == "vllm":
            config = VllmServerConfig(
                model_dir, port, dtype=args.vllm_dtype, threads=2 if two_threads else args.vllm_threads,
                served_model_name=model_dir.name, extra_args=tuple(shlex.split(args.vllm_args)),
                venv=args.vllm_venv, log_path=log_path,
            )
            label, settings, server = "vLLM CPU server", config.describe(), vllm_server(config)
            label += f" ({config.threads} thread{'s' if config.threads > 1 else ''})"
        else:
            label, layout = PDSERVE_LAYOUTS[base]
            threads = ("--threads-per-worker", "2") if two_threads else ()
            label += " (2 threads per worker)" if two_threads else ""
            command = [
                str(PDSERVE), "serve", "--model", str(model_dir), *layout, *threads,
                *shlex.split(args.pdserve_args), "--port", str(port),
            ]
            settings, server = " ".join(command), pdserve_server(command, log_path)
        print(f"{label}: starting ({settings})", flush=True)
        with server as url:
            figures = asyncio.run(measure(url, model_dir.name, load, vocab_size, args.seed))
        results[name] = {"label": label, "settings": settings, "log": str(log_path), **figures}
        write_report(results, args, load)  # after each server, so that a later failure keeps these


if __name__ == "__main__":
    main()
