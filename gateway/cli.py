"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence


def _prepare_model(args: argparse.Namespace) -> int:
    from llm_engine.default_model import prepare_default_model

    path = prepare_default_model(args.out)
    print(path)
    return 0


# Flags of `serve` that map one-to-one onto ServeConfig fields (dest name = field name).
_SERVE_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "Hugging Face model directory (default: SmolLM2-135M-Instruct, prepared on first use)"),
    ("--served-model-name", str, "model name clients send (default: the directory's name)"),
    ("--prefill", int, "prefill workers (default 1)"),
    ("--decode", int, "decode workers (default 1)"),
    ("--backend", str, "KV transfer backend: auto, nixl or torch (default auto)"),
    ("--dtype", str, "float32 or bfloat16"),
    ("--device", str, "cpu or cuda"),
    ("--block-size", int, "tokens per KV block"),
    ("--kv-cache-mib", int, "KV cache budget per worker, MiB"),
    ("--max-num-batched-tokens", int, "tokens per forward (prefill chunk budget)"),
    ("--host", str, "address to bind (default 127.0.0.1)"),
    ("--port", int, "port (default 8000)"),
    ("--api-key", str, "require this Bearer key on /v1 routes (or PDSERVE_API_KEY)"),
    ("--admin-key", str, "require this Bearer key on /admin routes (or PDSERVE_ADMIN_KEY)"),
    ("--address", str, "join this Ray cluster instead of starting a local one"),
    ("--max-waiting", int, "requests that may wait for decode KV capacity before 429"),
    ("--queue-timeout-s", float, "seconds a request may wait for capacity before 429"),
    ("--default-max-tokens", int, "max_tokens of chat requests that give none"),
]


def _serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from gateway.app import create_app
    from gateway.config import ServeConfig

    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_")) for flag, _, _ in
                 _SERVE_FLAGS}
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
        field = str(first["loc"][0]) if first["loc"] else "config"
        flag = "--address" if field == "ray_address" else "--" + field.replace("_", "-")
        print(f"pdserve serve: error: {flag}: {first['msg']}", file=sys.stderr)
        return 2
    uvicorn.run(create_app(config), host=config.host, port=config.port, loop="uvloop", log_level="info")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare-model",
        help="materialise the default model (SmolLM2-135M-Instruct) as a Hugging Face directory",
    )
    prepare.add_argument("--out", default=None,
                         help="directory to write (default: the cache, ~/.cache/pdserve/models/...)")
    prepare.set_defaults(handler=_prepare_model)
    serve = commands.add_parser("serve", help="serve a model through a prefill pool and a decode pool")
    serve.add_argument("--config", default=None, help="YAML file of the same settings (flags override it)")
    for flag, kind, text in _SERVE_FLAGS:
        serve.add_argument(flag, type=kind, default=None, help=text)
    serve.set_defaults(handler=_serve)
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
