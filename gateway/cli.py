"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast


def _prepare_model(args: argparse.Namespace) -> int:
    from llm_engine.default_model import prepare_default_model

    path = prepare_default_model(args.out)
    print(path)
    return 0


# Flags of `serve` that map one-to-one onto ServeConfig fields (dest name = field name).
_SERVE_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "Hugging Face model directory (default: SmolLM2-135M-Instruct, prepared on first use)"),
    ("--served-model-name", str, "model name clients send (default: the directory's name)"),
    ("--prefill", int, "prefill workers (default: 1 when no role is given, else 0)"),
    ("--decode", int, "decode workers (default: 1 when no role is given, else 0)"),
    ("--mixed", int, "workers that prefill and decode their own requests (the colocated layout; default 0)"),
    ("--colocated", int, "the old name of --mixed"),
    ("--backend", str, "KV transfer backend: auto, nixl, torch or local (default auto)"),
    ("--ratio", str, "fixed (default) or auto: a controller moves workers between roles by load"),
    ("--ttft-slo-s", float, "the ratio controller's time-to-first-token target, s"),
    ("--itl-slo-s", float, "the ratio controller's inter-token latency target, s"),
    ("--dtype", str, "float32 or bfloat16"),
    ("--device", str, "cpu or cuda"),
    ("--block-size", int, "tokens per KV block"),
    ("--kv-cache-mib", int, "KV cache budget per worker, MiB"),
    ("--max-num-batched-tokens", int, "tokens per forward (prefill chunk budget)"),
    ("--host", str, "address to bind (default 127.0.0.1)"),
    ("--port", int, "port (default 8000)"),
    ("--api-key", str, "require this Bearer key on /v1 routes and /metrics (or PDSERVE_API_KEY)"),
    ("--admin-key", str, "require this Bearer key on /admin routes (or PDSERVE_ADMIN_KEY)"),
    ("--address", str, "join this Ray cluster instead of starting a local one"),
    ("--max-waiting", int, "requests that may wait for decode KV capacity before 429"),
    ("--max-waiting-tokens", int, "tokens (prompt + max_tokens) that may wait before 429 (default: the KV)"),
    ("--queue-timeout-s", float, "seconds a request may wait for capacity before 429"),
    ("--deadline-slack-s", float, "request deadlines: slack per stage, s (defaults: gateway/deadlines.py)"),
    ("--deadline-prefill-s-per-token", float, "request deadlines: seconds per prompt token"),
    ("--deadline-decode-s-per-token", float, "request deadlines: seconds per output token"),
    ("--local-prefill-max-tokens", int, "decode workers prefill prompts with at most this many uncached "
                                        "tokens themselves (off unless set)"),
    ("--local-prefill-queue-tokens", int, "... or any prompt while every prefill worker has this many "
                                          "tokens queued (off unless set)"),
    ("--default-max-tokens", int, "max_tokens of chat requests that give none"),
]


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from gateway.app import create_app
    from gateway.config import ServeConfig

    overrides = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in _SERVE_FLAGS
    }
    overrides["ray_address"] = overrides.pop("address")
    overrides["api_key"] = overrides["api_key"] or os.environ.get("PDSERVE_API_KEY")
    overrides["admin_key"] = overrides["admin_key"] or os.environ.get("PDSERVE_ADMIN_KEY")
    try:
        if args.config:
            config = ServeConfig.from_yaml(args.config, **overrides)
        else:
            config = ServeConfig.model_validate({k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        if not first["loc"]:  # a check across fields: its message names the flags
            message = str(first["msg"]).removeprefix("Value error, ")
            print(f"pdserve serve: error: {message}", file=sys.stderr)
            return 2
        field = str(first["loc"][0])
        flag = "--address" if field == "ray_address" else "--" + field.replace("_", "-")
        print(f"pdserve serve: error: {flag}: {first['msg']}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop", log_level="info")
    return 0


def _bench(args: argparse.Namespace) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare-model",
        help="materialise the default model (SmolLM2-135M-Instruct) as a Hugging Face directory",
    )
    prepare.add_argument(
        "--out", default=None, help="directory to write (default: the cache, ~/.cache/pdserve/models/...)"
    )
    prepare.set_defaults(handler=_prepare_model)
    serve = commands.add_parser("serve", help="serve a model through a prefill pool and a decode pool")
    serve.add_argument("--config", default=None, help="YAML file of the same settings (flags override it)")
    for flag, kind, text in _SERVE_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=text)
    serve.set_defaults(handler=_serve)
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
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (FileNotFoundError, ValueError) as error:
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
