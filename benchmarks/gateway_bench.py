"""Gateway overhead (not a test): end-to-end time at the client minus the time the workers report for
themselves (prefill queue + prefill + transfer + decode queue + decode), at 1, 64 and 256 concurrent streams.

Starts a real server (`pdserve serve` in its own process: local Ray, 1 prefill + 1 decode, nixl) on the tiny
random Llama with SmolLM2's tokenizer, so that worker time is small and the gateway's own share is visible.
The client runs in this process. With --base DIR (a checkout of an earlier commit, e.g. a `git worktree`),
the same rows run against a server started from DIR too, alternating servers for --repeats rounds, so that
before and after are measured side by side on the same machine under the same load. With --frontends 1,2
the sides are this code with 1 and with 2 HTTP frontends (--api-server-count), alternating the same way.
Gateway CPU counts every gateway process: the server (with N > 1 the supervisor, every frontend and the
fleet actor), not Ray's own daemons nor the workers.

    .venv/bin/python benchmarks/gateway_bench.py [--requests 128] [--base /tmp/stream-base] [--repeats 2]
        [--frontends 1,2] [--out benchmarks/results/gateway.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import httpx

from benchmarks.server_ready import wait_compiled
from llm_engine.default_model import prepare_default_model
from llm_engine.tiny_model import build_tiny_llama
from loadgen.summary import percentile
from worker_runtime.process_heap import freeze_startup_heap

WORKER_STAGES = ("prefill_queue_ms", "prefill_ms", "transfer_ms", "decode_queue_ms", "decode_ms")


# Where the time goes, in the request's order: the gateway's hops between processes and the workers' stages
# (from the response's timings, where the server reports them), then the client's own share (its e2e minus
# the gateway's). The overhead is the hops plus the client's share.
PARTS = ("gateway_queue_ms", "to_prefill_ms", "prefill_queue_ms", "prefill_ms", "handoff_ms",
         "decode_queue_ms", "transfer_ms", "decode_ms", "delivery_ms", "client_ms")


async def one(session: aiohttp.ClientSession, max_tokens: int) -> tuple[float, float, dict[str, float]]:
    body = {"model": "tiny", "prompt": "Tell me a story about a fox", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    timings = None
    async with session.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # one SSE line at a time
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                timings = chunk.get("timings") or timings
    e2e_ms = 1000 * (time.perf_counter() - start)
    assert timings is not None
    worker_ms = sum(timings[s] for s in WORKER_STAGES)
    parts = {part: timings.get(part, float("nan")) for part in PARTS[:-1]}
    parts["client_ms"] = e2e_ms - timings["e2e_ms"]
    return e2e_ms, e2e_ms - worker_ms, parts


async def run(url: str, concurrency: int, num_requests: int, max_tokens: int
              ) -> list[tuple[float, float, dict[str, float]] | BaseException]:
    # aiohttp, as vLLM's benchmark client: the client shares this machine's cores with the server, and
    # httpx's per-line cost at 64 streams (37–81 ms of each request's time against aiohttp's 9–20, measured
    # side by side on one server) would be counted as the gateway's overhead.
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as session:
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded() -> tuple[float, float, dict[str, float]]:
            async with semaphore:
                return await one(session, max_tokens)

        # A failed request is counted, not fatal: the 256-stream row must say whether any failed.
        return list(await asyncio.gather(*(bounded() for _ in range(num_requests)), return_exceptions=True))


def start_server(model_dir: Path, code_dir: Path, frontends: int = 1) -> tuple[subprocess.Popen[bytes], str]:
    """`pdserve serve` from the checkout in `code_dir` (its actors import from there too), once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONPATH": str(code_dir)}
    command = [sys.executable, "-m", "pdserve", "serve", "--model", str(model_dir),
               "--served-model-name", "tiny", "--backend", "nixl", "--port", str(port),
               "--kv-cache-mib", "64", "--max-waiting", "1024"]
    if frontends > 1:
        command += ["--api-server-count", str(frontends)]
    server = subprocess.Popen(command, env=env, cwd=code_dir, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                wait_compiled(f"http://127.0.0.1:{port}")  # its workers at their steady speed
                return server, f"http://127.0.0.1:{port}"
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"pdserve serve from {code_dir} did not come up")
        time.sleep(0.5)


Row = tuple[float, float, float, float, int, dict[str, float], float]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (all its threads: the event loop, Ray's core worker)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def gateway_pids(server_pid: int) -> list[int]:
    """The server, its frontend processes (uvicorn's spawned children) and the fleet actor, if any."""
    import psutil

    pids = [server_pid]
    pids += [p.pid for p in psutil.Process(server_pid).children()
             if "spawn_main" in " ".join(p.cmdline())]
    pids += [p.pid for p in psutil.process_iter(["cmdline"])
             if "FleetActor" in " ".join(p.info["cmdline"] or [])]
    return pids


def gateway_cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def measure(model_dir: Path, code_dir: Path, streams: list[int], num_requests: int, max_tokens: int,
            frontends: int = 1) -> dict[int, Row]:
    """Per concurrency: e2e p50, e2e p99, overhead p50, overhead p99 (ms), failed requests, the p50 of
    each part of the overhead, and the gateway processes' CPU ms per request."""
    server, url = start_server(model_dir, code_dir, frontends)
    rows: dict[int, Row] = {}
    try:
        asyncio.run(run(url, 4, 8, max_tokens))  # warm-up
        pids = gateway_pids(server.pid)
        for concurrency in streams:
            cpu_before = gateway_cpu_seconds(pids)
            outcomes = asyncio.run(run(url, concurrency, max(num_requests, concurrency), max_tokens))
            cpu_ms = 1000 * (gateway_cpu_seconds(pids) - cpu_before) / len(outcomes)
            results = [r for r in outcomes if isinstance(r, tuple)]
            e2e = [r[0] for r in results]
            overhead = [r[1] for r in results]
            parts = {part: percentile([r[2][part] for r in results], 50) for part in PARTS}
            rows[concurrency] = (percentile(e2e, 50), percentile(e2e, 99), percentile(overhead, 50),
                                 percentile(overhead, 99), len(outcomes) - len(results), parts, cpu_ms)
            print(code_dir, concurrency, rows[concurrency], flush=True)
    finally:
        server.send_signal(signal.SIGINT)  # the server's Ctrl-C path: shuts its actors and Ray down
        server.wait(120)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128, help="per row (at least one per stream)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--streams", default="1,64,256", help="concurrent streams, one row each")
    parser.add_argument("--base", type=Path, help="a checkout of the commit to compare against")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (alternating servers)")
    parser.add_argument("--frontends", help="e.g. 1,2: compare these --api-server-count values (this code)")
    parser.add_argument("--out", default="benchmarks/results/gateway.md")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    build_tiny_llama(model_dir, vocab_size=49152)
    smol = prepare_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(smol / name, model_dir / name)
    # The client's own full collections over what setup imported (torch, transformers) would count as
    # the server's overhead; the servers freeze theirs the same way (worker_runtime/process_heap.py).
    freeze_startup_heap()
    streams = [int(n) for n in args.streams.split(",")]
    here = Path(__file__).resolve().parents[1]
    sides: dict[str, tuple[Path, int]]
    if args.frontends:
        sides = {f"{n} frontend(s)": (here, int(n)) for n in args.frontends.split(",")}
    elif args.base:
        sides = {"before": (args.base.resolve(), 1), "after": (here, 1)}
    else:
        sides = {"now": (here, 1)}
    runs: dict[str, list[dict[int, Row]]] = {side: [] for side in sides}
    for _ in range(args.repeats):
        for side, (code_dir, frontends) in sides.items():
            runs[side].append(measure(model_dir, code_dir, streams, args.requests, args.max_tokens,
                                      frontends))
    lines = [
        f"# Gateway overhead ({datetime.now(UTC):%Y-%m-%d}, {platform.node()}, {os.cpu_count()} cores)",
        "",
        f"Tiny random Llama (4 layers) with SmolLM2's tokenizer, 1 prefill + 1 decode (nixl), streaming "
        f"completions of {args.max_tokens} tokens, max({args.requests}, streams) requests per row. "
        "Overhead = client end-to-end minus the workers' own stages (prefill queue + prefill + transfer + "
        f"decode queue + decode). Medians over {args.repeats} round(s), the servers alternating; [min–max] "
        "across rounds.",
        f"Command: `.venv/bin/python benchmarks/gateway_bench.py --streams {args.streams} --repeats "
        f"{args.repeats}{' --base ' + str(args.base) if args.base else ''}"
        f"{' --frontends ' + args.frontends if args.frontends else ''}`",
        "",
        "Gateway CPU = user + system CPU time of the gateway's processes (/proc: the server; with several "
        "frontends also each frontend and the fleet actor) over the row / its requests.",
        "",
        "| code | streams | e2e p50 ms | e2e p99 ms | overhead p50 ms | overhead p99 ms | gateway CPU ms per "
        "request | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for concurrency in streams:
        for side in sides:
            rows = [r[concurrency] for r in runs[side]]

            def cell(i: int, rows: list[Row] = rows) -> str:
                values = [r[i] for r in rows]
                spread = f" [{min(values):.1f}–{max(values):.1f}]" if len(values) > 1 else ""
                return f"{statistics.median(values):.1f}{spread}"

            cells = " | ".join(cell(i) for i in (0, 1, 2, 3, 6))
            lines.append(f"| {side} | {concurrency} | {cells} | {sum(r[4] for r in rows)} |")
    lines += ["", "Where the time goes (p50 ms of each part, median over rounds; nan: not reported by that "
              "code). Hops and stages from the response's timings; client = client e2e − the gateway's e2e.",
              "",
              "| code | streams | " + " | ".join(p.removesuffix("_ms") for p in PARTS) + " |",
              "|---|---:|" + "---:|" * len(PARTS)]
    for concurrency in streams:
        for side in sides:
            medians = [statistics.median(r[concurrency][5][part] for r in runs[side]) for part in PARTS]
            lines.append(f"| {side} | {concurrency} | " + " | ".join(f"{m:.1f}" for m in medians) + " |")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
