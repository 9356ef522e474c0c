"""`pdserve serve`: the gateway and its pools. Its flags are made from gateway/config.py ServeConfig (one flag
and one PDSERVE_<FIELD> environment variable per field, pdserve/settings_cli.py), over an optional YAML
file (`--config`). Precedence: flags > environment > YAML > defaults."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdserve.settings_cli import PRECEDENCE, add_model_flags, error_message, given_flags, layer_sources
from pdserve.vllm_flags import add_vllm_flags, translate_vllm_flags

# Flags beside `--field-name`, shown in the help.
ALIASES = {"ray_address": ["--address"], "tensor_parallel_size": ["-tp"], "quantization": ["-q"]}


def add_serve_parser(commands: Any) -> None:
    from gateway.config import ENV_PREFIX, ServeConfig

    serve = commands.add_parser(
        "serve", help="serve a model through a prefill pool and a decode pool",
        epilog=f"Every setting is also an environment variable {ENV_PREFIX}<FLAG NAME> (e.g. "
               "PDSERVE_PORT, PDSERVE_API_KEY) and a key of the --config YAML (e.g. port: 8000). "
               f"Precedence: {PRECEDENCE}.")
    serve.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                       help="the model to serve, as --model (vLLM's `serve MODEL`)")
    serve.add_argument("--config", default=None,
                       help="YAML file of the same settings, keys as the flags with underscores "
                            "(default: none)")
    add_model_flags(serve, ServeConfig, aliases=ALIASES)
    add_vllm_flags(serve)
    serve.set_defaults(handler=run_serve)


def load_serve_config(args: argparse.Namespace) -> Any:
    """The ServeConfig of these arguments (flags > environment > YAML > defaults).

    Raises:
        ValueError: a setting pydantic refuses, the message naming its flag (and its source if not a flag).
    """
    from pydantic import ValidationError

    from gateway.config import ServeConfig

    flags = given_flags(args, ServeConfig)
    if args.model_arg is not None:
        if flags.get("model", args.model_arg) != args.model_arg:
            raise ValueError(f"--model: given twice ({args.model_arg!r} and --model {flags['model']!r})")
        flags["model"] = args.model_arg
    flags = translate_vllm_flags(args, flags)  # vLLM's spellings: no-ops, renames, or a refusal naming it
    try:
        return ServeConfig.from_yaml(args.config, **flags)
    except ValidationError as error:
        sources = layer_sources(ServeConfig, flags, ServeConfig.env_values(), args.config)
        raise ValueError(error_message(error, sources)) from None


def run_serve(args: argparse.Namespace) -> int:
    from llm_engine.hardware import check_device_present, resolve_device

    try:
        config = load_serve_config(args)
        if config.ray_address is None:  # the workers run on this machine: a missing GPU is known now
            check_device_present(resolve_device(config.device or "auto"))
    except ValueError as error:
        print(f"pdserve serve: error: {error}", file=sys.stderr)
        return 2
    from gateway.startup import resolve_model_dir

    # Before Ray starts: a model id that cannot be resolved fails here, naming --model.
    resolve_model_dir(config)
    from gateway.frontends import serve_frontends

    serve_frontends(config)  # the fleet actor, and --api-server-count frontends over it
    return 0
