"""Conditional disaggregation (not a test): TTFT of short chat prompts when the decode worker prefills them
itself (`--local-prefill-max-tokens 64`) against always handing them off through the prefill pool.

Serves SmolLM2-135M (`pdserve serve` in its own process, 1 prefill + 1 decode, nixl) once per setting, in
the order off, on, off, on (so slow drift of a shared machine shows as a difference between rounds), and
sends each server the same sequential short chat requests. Prints medians per round and the on/off ratio.

    .venv/bin/python benchmarks/local_prefill_bench.py [--requests 20] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

from benchmarks.server_ready import wait_compiled
from llm_engine.default_model import prepare_default_model

QUESTIONS = ["Hi!", "What is 2+2?", "Name a colour.", "Say hello.", "What day comes after Monday?"]


def serve(model_dir: Path, local_max_tokens: int) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pdserve", "serve", "--model", str(model_dir), "--backend", "nixl",
               "--port", str(port), "--kv-cache-mib", "256",
               "--local-prefill-max-tokens", str(local_max_tokens)]
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).json().get("status") == "ok":
                wait_compiled(url)  # its workers at their steady speed
                return server, url
        except (httpx.TransportError, ValueError):
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("pdserve serve did not come up")
        time.sleep(0.5)


def measure(url: str, model: str, num_requests: int) -> tuple[list[float], list[float], set[str]]:
    ttft, e2e, where = [], [], set()
    with httpx.Client(base_url=url, timeout=300) as client:
        for index in range(num_requests + 2):  # the first two warm the server up and are not counted
            body = {"model": model, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": QUESTIONS[index % len(QUESTIONS)]}]}
            timings = client.post("/v1/chat/completions", json=body).json()["timings"]
            if index >= 2:
                ttft.append(timings["ttft_ms"])
                e2e.append(timings["e2e_ms"])
                where.add(timings["prefill_on"])
    return ttft, e2e, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/local_prefill.md")
    args = parser.parse_args()
    model_dir = prepare_default_model()
    rows = []
    medians: dict[int, list[float]] = {0: [], 64: []}
    for round_index, local_max in enumerate((0, 64, 0, 64)):
        server, url = serve(model_dir, local_max)
        try:
            ttft, e2e, where = measure(url, model_dir.name, args.requests)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(120)
        medians[local_max].append(statistics.median(ttft))
        rows.append(f"| {round_index + 1} | {local_max or 'off'} | {'/'.join(sorted(where))} | "
                    f"{statistics.median(ttft):.0f} | {statistics.median(e2e):.0f} |")
        print(rows[-1], flush=True)
    ratio = statistics.median(medians[64]) / statistics.median(medians[0])
    lines = [
        f"# Conditional disaggregation ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"SmolLM2-135M fp32, 1 prefill + 1 decode (nixl), {args.requests} sequential short chat requests "
        "(about 30 prompt tokens with the chat template, 8 output tokens) per round.",
        "Command: `.venv/bin/python benchmarks/local_prefill_bench.py`",
        "",
        "| round | --local-prefill-max-tokens | prefill ran on | TTFT p50 ms | e2e p50 ms |",
        "|---:|---|---|---:|---:|",
        *rows,
        "",
        f"TTFT p50, local prefill / handed off (median of the two rounds each): {ratio:.2f}",
    ]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
