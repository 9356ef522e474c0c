"""A small model for benchmarks that run more workers than two cores can hold with the default model (not a
test): SmolLM2-135M's architecture cut to 8 of its 30 layers, random weights, SmolLM2's tokenizer and chat
template. Its steps cost about a quarter of the real model's, and its context is the same (8192), so the
loads that send 1500-token prompts fit.

    .venv/bin/python benchmarks/small_model.py OUT_DIR [--layers 8]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM

from llm_engine.default_model import prepare_default_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def build_small_model(out: Path, num_layers: int = 8) -> Path:
    source = prepare_default_model()
    config = AutoConfig.from_pretrained(source)
    config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    print(build_small_model(args.out, args.layers))


if __name__ == "__main__":
    main()
