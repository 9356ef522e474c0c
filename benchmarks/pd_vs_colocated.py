"""The first disaggregation result (not a test): 1 prefill + 1 decode vs 2 colocated workers, same load.

On this 2-core machine with SmolLM2-135M (one torch thread per worker), each setup is served by a real
`pdserve serve` and driven by `pdserve bench` with Azure-conversation-shaped requests (the trace's first
requests in order, prompt and output lengths × LENGTH_SCALE, Poisson arrivals) at three rates. Writes per-run
directories, a comparison table (table.md) and a plot (comparison.png) under --out.

    .venv/bin/python benchmarks/pd_vs_colocated.py [--rates 0.3 0.7 1.1] [--duration 60]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.server_ready import wait_compiled
from loadgen.client import PINNED
from loadgen.runner import BenchConfig, run_bench

SETUPS = {
    "1P+1D": ["--prefill", "1", "--decode", "1", "--backend", "nixl"],
    "2 colocated": ["--colocated", "2"],
}
TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_conv_2023.csv"


def start_server(flags: list[str], port: int, code_dir: Path | None = None) -> subprocess.Popen[bytes]:
    """`pdserve serve` with `flags`, once healthy; from the checkout in `code_dir` (an earlier commit's
    worktree: its actors import from there too) when given."""
    command = [
        sys.executable,
        "-m",
        "pdserve",
        "serve",
        "--port",
        str(port),
        "--kv-cache-mib",
        "512",
        "--max-num-batched-tokens",
        "512",
        "--max-waiting",
        "1024",
        "--queue-timeout-s",
        "600",
        *flags,
    ]
    server = subprocess.Popen(
        command,
        env={**os.environ, "UCX_NET_DEVICES": "lo", **({"PYTHONPATH": str(code_dir)} if code_dir else {})},
        cwd=code_dir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                wait_compiled(f"http://127.0.0.1:{port}")  # its workers at their steady speed
                return server
        except httpx.TransportError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"pdserve serve {' '.join(flags)} did not come up")
        time.sleep(1)


@contextlib.contextmanager
def served(flags: list[str], code_dir: Path | None = None) -> Iterator[str]:
    """`pdserve serve` with `flags` on a free port (see start_server) for the block; yields its URL and
    stops it (Ctrl-C: its actors and Ray shut down) after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(flags, port, code_dir)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rates", type=float, nargs=3, default=[0.3, 0.7, 1.1], help="light, medium, near saturation"
    )
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--ttft-slo", type=float, default=3.0)
    parser.add_argument("--itl-slo", type=float, default=0.2)
    parser.add_argument("--out", default="benchmarks/results/pd_vs_colocated")
    args = parser.parse_args()
    out = Path(args.out)
    summaries: dict[str, dict[float, dict]] = {}
    for name, flags in SETUPS.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = start_server(flags, port)
        try:
            for rate in args.rates:
                run_dir = out / name.replace(" ", "_").replace("+", "") / f"rate_{rate}"
                config = BenchConfig(
                    url=f"http://127.0.0.1:{port}",
                    out_dir=run_dir,
                    rate=rate,
                    num_requests=10_000,
                    duration_s=args.duration,
                    dataset="trace", dataset_path=TRACE, options=PINNED,
                    length_scale=args.length_scale,
                    ttft_slo_s=args.ttft_slo,
                    itl_slo_s=args.itl_slo,
                    vocab_size=49152,
                    show_progress=False,
                )
                summary = run_bench(config)
                summaries.setdefault(name, {})[rate] = summary
                print(name, rate, json.dumps({k: summary[k] for k in ("num_ok", "goodput")}), flush=True)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(120)
    write_report(summaries, args, out)


def write_report(summaries: dict[str, dict[float, dict]], args: argparse.Namespace, out: Path) -> None:
    pd, co = summaries["1P+1D"], summaries["2 colocated"]
    lines = [
        f"# 1 prefill + 1 decode vs 2 colocated workers ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"SmolLM2-135M fp32 on 2 CPU cores, one torch thread per worker. Load: Azure conversation trace "
        f"(first requests, in order), prompt and output lengths × {args.length_scale}, Poisson arrivals for "
        f"{args.duration:.0f} s per rate. Goodput SLO: TTFT ≤ {args.ttft_slo} s and TPOT ≤ {args.itl_slo} s.",
        "Command: `.venv/bin/python benchmarks/pd_vs_colocated.py`",
        "",
        "| rate req/s | setup | requests | ITL p99 ms | TTFT p90 ms | TPOT p90 ms | goodput req/s "
        "| prefill p90 ms | transfer p90 ms | decode queue p90 ms |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rate in args.rates:
        for name, runs in (("1P+1D", pd), ("2 colocated", co)):
            s = runs[rate]
            stage = s["stage_ms_over_requests"]
            lines.append(
                f"| {rate} | {name} | {s['num_ok']} | {1000 * s['itl_s_over_tokens']['p99']:.0f} | "
                f"{1000 * s['ttft_s_over_requests']['p90']:.0f} | "
                f"{1000 * s['tpot_s_over_requests']['p90']:.0f} | {s['goodput']:.2f} | "
                f"{stage['prefill_ms']['p90']:.0f} | {stage['transfer_ms']['p90']:.1f} | "
                f"{stage['decode_queue_ms']['p90']:.0f} |"
            )
    lines += [
        "",
        "| rate | ITL p99 colocated / PD | TTFT p90 PD / colocated | goodput PD / colocated |",
        "|---:|---:|---:|---:|",
    ]
    for rate in args.rates:
        p, c = pd[rate], co[rate]
        ratio_goodput = p["goodput"] / c["goodput"] if c["goodput"] else float("inf")
        lines.append(
            f"| {rate} | {c['itl_s_over_tokens']['p99'] / p['itl_s_over_tokens']['p99']:.2f}× | "
            f"{p['ttft_s_over_requests']['p90'] / c['ttft_s_over_requests']['p90']:.2f}× | "
            f"{ratio_goodput:.2f}× |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for name, runs in (("1P+1D", pd), ("2 colocated", co)):
        rates = list(args.rates)
        axes[0].plot(rates, [1000 * runs[r]["itl_s_over_tokens"]["p99"] for r in rates], "o-", label=name)
        axes[1].plot(rates, [1000 * runs[r]["ttft_s_over_requests"]["p90"] for r in rates], "o-", label=name)
        axes[2].plot(rates, [runs[r]["goodput"] for r in rates], "o-", label=name)
    for ax, title in zip(axes, ("ITL p99 (ms)", "TTFT p90 (ms)", "goodput (req/s)"), strict=True):
        ax.set(xlabel="request rate (req/s)", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "comparison.png", dpi=100)


if __name__ == "__main__":
    main()
