"""The `pdserve` command line: the composition root of the product. Each command lives in its own module
(serve, bench, tune) and registers its flags here; nothing below the command line imports this package.

    pdserve prepare-model | quantize | serve | bench | tune {profile, plan, validate} | fleet {list, stop}
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from pdserve import __version__
from pdserve.bench import add_bench_parser
from pdserve.fleet import add_fleet_parser
from pdserve.quantize import add_quantize_parser
from pdserve.serve import add_serve_parser
from pdserve.tune import add_tune_parser
from pdserve.vllm_flags import unknown_flag_message


def _prepare_model(args: argparse.Namespace) -> int:
    from llm_engine.default_model import prepare_default_model

    path = prepare_default_model(args.out)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    prepare = commands.add_parser(
        "prepare-model",
        help="materialise the default model (SmolLM2-135M-Instruct) as a Hugging Face directory",
    )
    prepare.add_argument(
        "--out", default=None, help="directory to write (default: the cache, ~/.cache/pdserve/models/...)"
    )
    prepare.set_defaults(handler=_prepare_model)
    add_quantize_parser(commands)
    add_serve_parser(commands)
    add_bench_parser(commands)
    add_tune_parser(commands)
    add_fleet_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would say "unrecognized arguments"; this says where the flags are listed
        parser.error(unknown_flag_message(args.command, unknown))
    try:
        return int(args.handler(args))
    except (FileNotFoundError, ValueError) as error:
        print(f"pdserve {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
