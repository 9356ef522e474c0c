"""`pdserve bench`: open-loop load against an OpenAI-compatible server (the loadgen package)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, cast


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="open-loop load against an OpenAI-compatible server")
    bench.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    bench.add_argument("--model", default=None, help="model name (default: the first the server lists)")
    bench.add_argument("--rate", type=float, default=None, help="requests/s (omit to replay --trace times)")
    bench.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    bench.add_argument("--speed", type=float, default=1.0, help="trace replay speed-up")
    bench.add_argument("--num-requests", type=int, default=100)
    bench.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    bench.add_argument("--input-len", type=int, default=None, help="fixed prompt tokens")
    bench.add_argument("--output-len", type=int, default=None, help="fixed output tokens")
    bench.add_argument("--trace", default=None, help="Azure CSV or Mooncake JSONL trace")
    bench.add_argument("--length-scale", type=float, default=1.0, help="multiply trace lengths by this")
    bench.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO, seconds (goodput)")
    bench.add_argument("--itl-slo", type=float, default=0.2, help="TPOT/ITL SLO, seconds (goodput)")
    bench.add_argument(
        "--vocab-size", type=int, default=32000, help="random prompt token ids stay below this"
    )
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--api-key", default=None)
    bench.add_argument("--out", default="bench-out", help="results directory")
    bench.add_argument("--no-progress", action="store_true")
    bench.set_defaults(handler=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    from loadgen.runner import BenchConfig, run_bench

    if args.rate is None and args.trace is None:
        print(
            "pdserve bench: error: --rate: give a rate, or --trace to replay its timestamps", file=sys.stderr
        )
        return 2
    if args.trace is None and (args.input_len is None or args.output_len is None):
        print("pdserve bench: error: --input-len/--output-len: needed without --trace", file=sys.stderr)
        return 2
    for flag, value in (
        ("--rate", args.rate),
        ("--burstiness", args.burstiness),
        ("--length-scale", args.length_scale),
        ("--num-requests", args.num_requests),
    ):
        if value is not None and value <= 0:
            print(f"pdserve bench: error: {flag}: must be > 0, got {value}", file=sys.stderr)
            return 2
    config = BenchConfig(
        url=args.url.rstrip("/"),
        out_dir=Path(args.out),
        model=args.model,
        rate=args.rate,
        burstiness=args.burstiness,
        speed=args.speed,
        num_requests=args.num_requests,
        duration_s=args.duration,
        input_len=args.input_len,
        output_len=args.output_len,
        trace=Path(args.trace) if args.trace else None,
        length_scale=args.length_scale,
        ttft_slo_s=args.ttft_slo,
        itl_slo_s=args.itl_slo,
        vocab_size=args.vocab_size,
        seed=args.seed,
        api_key=args.api_key or os.environ.get("PDSERVE_API_KEY"),
        show_progress=not args.no_progress,
    )
    summary = run_bench(config)
    ttft = cast(dict[str, float], summary["ttft_s_over_requests"])
    itl = cast(dict[str, float], summary["itl_s_over_tokens"])
    print(
        f"{summary['num_ok']}/{summary['num_requests']} ok; TTFT p90 {1000 * ttft['p90']:.0f} ms; "
        f"ITL p99 {1000 * itl['p99']:.0f} ms; goodput {summary['goodput']:.2f} req/s; results in {args.out}"
    )
    return 0


