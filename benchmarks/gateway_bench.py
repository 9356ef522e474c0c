"""Gateway overhead (not a test): end-to-end time at the client minus the time the workers report for
themselves (prefill queue + prefill + transfer + decode queue + decode), at 1 and at 64 concurrent streams.

Starts a real server (`pdserve serve` in its own process: local Ray, 1 prefill + 1 decode, nixl) on the tiny
random Llama with SmolLM2's tokenizer, so that worker time is small and the gateway's own share is visible.
The client runs in this process.

    .venv/bin/python benchmarks/gateway_bench.py [--requests 128] [--out benchmarks/results/gateway.md]
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
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from llm_engine.default_model import prepare_default_model
from llm_engine.tiny_model import build_tiny_llama

WORKER_STAGES = ("prefill_queue_ms", "prefill_ms", "transfer_ms", "decode_queue_ms", "decode_ms")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one(client: httpx.AsyncClient, max_tokens: int) -> tuple[float, float]:
    body = {"model": "tiny", "prompt": "Tell me a story about a fox", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    timings = None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                timings = chunk.get("timings") or timings
    e2e_ms = 1000 * (time.perf_counter() - start)
    assert timings is not None
    worker_ms = sum(timings[s] for s in WORKER_STAGES)
    return e2e_ms, e2e_ms - worker_ms


async def run(url: str, concurrency: int, num_requests: int, max_tokens: int) -> list[tuple[float, float]]:
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        semaphore = asyncio.Semaphore(concurrency)

        async def bounded() -> tuple[float, float]:
            async with semaphore:
                return await one(client, max_tokens)

        return list(await asyncio.gather(*(bounded() for _ in range(num_requests))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", default="benchmarks/results/gateway.md")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    build_tiny_llama(model_dir, vocab_size=49152)
    smol = prepare_default_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy2(smol / name, model_dir / name)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    command = [sys.executable, "-m", "commands", "serve", "--model", str(model_dir),
               "--served-model-name", "tiny", "--backend", "nixl", "--port", str(port),
               "--kv-cache-mib", "64", "--max-waiting", "1024"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("pdserve serve did not come up")
        time.sleep(0.5)
    url = f"http://127.0.0.1:{port}"
    lines = [
        f"# Gateway overhead ({datetime.now(UTC):%Y-%m-%d}, {platform.node()})",
        "",
        f"Tiny random Llama (4 layers) with SmolLM2's tokenizer, 1 prefill + 1 decode (nixl), streaming "
        f"completions of {args.max_tokens} tokens, {args.requests} requests per row. Overhead = client "
        "end-to-end minus the workers' own stages (prefill queue + prefill + transfer + decode queue + "
        "decode).",
        "Command: `.venv/bin/python benchmarks/gateway_bench.py`",
        "",
        "| concurrent streams | e2e p50 ms | e2e p99 ms | overhead p50 ms | overhead p99 ms |",
        "|---:|---:|---:|---:|---:|",
    ]
    try:
        asyncio.run(run(url, 4, 8, args.max_tokens))  # warm-up
        for concurrency in (1, 64):
            results = asyncio.run(run(url, concurrency, args.requests, args.max_tokens))
            e2e = [r[0] for r in results]
            overhead = [r[1] for r in results]
            lines.append(f"| {concurrency} | {percentile(e2e, 50):.1f} | {percentile(e2e, 99):.1f} | "
                         f"{percentile(overhead, 50):.1f} | {percentile(overhead, 99):.1f} |")
            print(lines[-1], flush=True)
    finally:
        server.send_signal(signal.SIGINT)  # the server's Ctrl-C path: shuts its actors and Ray down
        server.wait(120)
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
