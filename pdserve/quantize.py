"""`pdserve quantize`: write a checkpoint with integer weights that `pdserve serve` (and vLLM) loads
(llm_engine/checkpoint_quantizer.py does the work).

    pdserve quantize --scheme W8A8 --out DIR [--model DIR] [--group-size 64]
"""

from __future__ import annotations

import argparse
from typing import Any

from llm_engine.weight_schemes import QUANTIZE_SCHEMES


def _quantize(args: argparse.Namespace) -> int:
    from llm_engine.checkpoint_quantizer import quantize_checkpoint
    from llm_engine.default_model import prepare_default_model

    model = args.model if args.model is not None else prepare_default_model()
    print(quantize_checkpoint(model, args.out, args.scheme, args.group_size))
    return 0


def add_quantize_parser(commands: Any) -> None:
    quantize = commands.add_parser(
        "quantize", help="write a model's checkpoint with int8 or int4 weights (compressed-tensors' format)")
    quantize.add_argument("--model", default=None,
                          help="an unquantized model directory of the Llama, Mistral or Qwen2/3 families "
                               "(default: SmolLM2-135M-Instruct)")
    quantize.add_argument("--out", required=True, help="the directory to write (replaced if it exists)")
    quantize.add_argument("--scheme", default="W8A8", type=str.upper, choices=QUANTIZE_SCHEMES,
                          help="W8A8: int8 weights per channel, int8 activations per token at run time; "
                               "W8A16: int8 weights; W4A16(_ASYM): int4 weights per group of columns "
                               "(default: W8A8)")
    quantize.add_argument("--group-size", type=int, default=None,
                          help="int4 columns per scale: 32, 64 or 128 (default: the largest up to 128 that "
                               "divides the model's widths: 64 for SmolLM2)")
    quantize.set_defaults(handler=_quantize)
