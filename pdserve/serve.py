"""`pdserve serve`: the gateway and its pools, from flags or a YAML file (gateway/config.py ServeConfig)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (argparse names this function in its error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


# Flags of `serve` that map one-to-one onto ServeConfig fields (dest name = field name).
_SERVE_FLAGS: list[tuple[str, Callable[[str], Any], str]] = [
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
    ("--profile", str, "a worker's profile (pdserve tune profile): with --ratio auto, the controller also "
                       "replays the last minute's traffic through the simulator on every layout and moves "
                       "toward the one it predicts best"),
    ("--dtype", str, "auto (default: bfloat16 where the hardware runs it natively: AVX512_BF16 or AMX on a "
                     "CPU, any CUDA GPU; else float32), float32, bfloat16, or float16 (CUDA only)"),
    ("--device", str, "cpu or cuda"),
    ("--linear-kernel", str, "GEMM kernel of the linear layers: auto (default: probed at load, per weight "
                             "shape), torch (F.linear) or onednn-packed (CPU: weights prepacked once)"),
    ("--decode-attention", str, "auto (default: sdpa), sdpa (gather + torch SDPA, bit-identical to "
                                "transformers) or paged-kernel (pdserve's C++ kernel, CPU only, "
                                "experimental: no faster in whole steps yet)"),
    ("--threads-per-worker", int, "torch threads per worker (default: this machine's cores split over the "
                                  "workers; on a cluster, --cpus-per-worker); each worker is pinned to its "
                                  "own cores"),
    ("--block-size", int, "tokens per KV block"),
    ("--kv-cache-mib", int, "KV cache budget per worker, MiB"),
    ("--max-num-batched-tokens", int, "tokens per forward (prefill chunk budget)"),
    ("--max-prefill-s-beside-decode", float, "seconds of prompt work a worker adds to a step while it also "
                                             "decodes (mixed workers): prompts are sliced to fit, from "
                                             "measured step times, so streams there are not stalled by "
                                             "a whole prompt chunk (default 0: off; it costs prefill "
                                             "throughput on a CPU, see README)"),
    ("--host", str, "address to bind (default 127.0.0.1)"),
    ("--port", int, "port (default 8000)"),
    ("--api-server-count", int, "HTTP frontend processes on that port, sharing one fleet of workers (in a "
                                "named Ray actor); one that dies is restarted (default 1: the whole gateway "
                                "in one process)"),
    ("--api-key", str, "require this Bearer key on /v1 routes and /metrics (or PDSERVE_API_KEY)"),
    ("--admin-key", str, "require this Bearer key on /admin routes (or PDSERVE_ADMIN_KEY)"),
    ("--address", str, "join this Ray cluster instead of starting a local one ('auto': the cluster this "
                       "node belongs to, e.g. on a Ray head)"),
    ("--prefill-resources", json_object, "Ray custom resources each prefill worker asks for, as JSON, e.g. "
                                         "'{\"pdserve_prefill\": 1}': only nodes offering them run prefill"),
    ("--decode-resources", json_object, "the same for decode workers, e.g. '{\"pdserve_decode\": 1}'"),
    ("--mixed-resources", json_object, "the same for mixed workers"),
    ("--gpus-per-worker", float, "GPUs each worker asks Ray for (default: 1 with --device cuda, else 0; "
                                 "fractions share a GPU)"),
    ("--cpus-per-worker", float, "CPUs each worker asks Ray for (default 1)"),
    ("--worker-env", json_object, "environment of every worker process as JSON, e.g. "
                                  "'{\"UCX_NET_DEVICES\": \"mlx5_0:1\"}' (see deploy/README.md)"),
    ("--placement-timeout-s", float, "how long start-up waits for Ray to place every worker before it serves "
                                     "with those placed, or fails naming what no node offers (default: "
                                     "gateway/fleet/config.py)"),
    ("--autoscale-wait-s", float, "the Ray cluster autoscales: PUT /admin/pools accepts layouts beyond "
                                  "the resources free now; new workers wait pending for a node up to this "
                                  "many seconds, then are given up as unplaceable (default: off, such a "
                                  "layout is refused)"),
    ("--max-waiting", int, "requests that may wait for decode KV capacity before 429"),
    ("--max-waiting-tokens", int, "tokens (prompt + max_tokens) that may wait before 429 (default: the KV)"),
    ("--queue-timeout-s", float, "seconds a request may wait for capacity before 429"),
    ("--deadline-slack-s", float, "request deadlines: slack per stage, s (defaults: "
                                  "gateway/requests/deadlines.py)"),
    ("--deadline-prefill-s-per-token", float, "request deadlines: seconds per prompt token"),
    ("--deadline-decode-s-per-token", float, "request deadlines: seconds per output token"),
    ("--local-prefill-max-tokens", int, "decode workers prefill prompts with at most this many uncached "
                                        "tokens themselves (off unless set)"),
    ("--local-prefill-queue-tokens", int, "... or any prompt while every prefill worker has this many "
                                          "tokens queued (off unless set)"),
    ("--default-max-tokens", int, "max_tokens of chat requests that give none"),
    ("--tool-call-parser", str, "how the model writes tool calls: hermes (<tool_call> JSON: Qwen2, Hermes, "
                                "ChatML), llama3_json, or auto (detected from the chat template; default)"),
]



def add_serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="serve a model through a prefill pool and a decode pool")
    serve.add_argument("--config", default=None, help="YAML file of the same settings (flags override it)")
    for flag, kind, text in _SERVE_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=text)
    serve.add_argument("--no-pin-cpus", dest="pin_cpus", action="store_false", default=None,
                       help="let the OS place the workers' threads, instead of pinning each worker to its "
                            "own cores")
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from gateway.app import create_app
    from gateway.config import ServeConfig

    overrides = {
        flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in _SERVE_FLAGS
    }
    overrides["ray_address"] = overrides.pop("address")
    overrides["pin_cpus"] = args.pin_cpus
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
    if config.api_server_count > 1:
        from gateway.frontends import serve_frontends

        serve_frontends(config)
        return 0
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop", log_level="info")
    return 0


