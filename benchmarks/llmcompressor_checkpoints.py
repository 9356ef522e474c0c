"""SmolLM2-135M-Instruct quantized by llm-compressor itself (the checkpoints users bring), for
benchmarks/quant_closeness.py to serve. llm-compressor pins transformers ≤ 5.17 (pdserve's is newer), so this
runs in a venv of its own, never pdserve's:

    python3.11 -m venv /tmp/lc && /tmp/lc/bin/pip install torch==2.13.0 llmcompressor "transformers<=5.17"
    /tmp/lc/bin/python benchmarks/llmcompressor_checkpoints.py --model DIR --out OUT_DIR
    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_closeness.py --schemes W8A8,W4A16 \\
        --checkpoint llmc-W8A8=OUT_DIR/W8A8 --checkpoint llmc-W4A16=OUT_DIR/W4A16
The recipes are llm-compressor's presets with round-to-nearest (no calibration data): W8A8 (int8 weights per
channel, dynamic per-token int8 activations) and W4A16 (int4 weights in groups of 128 by default: SmolLM2's
576 columns do not split into 128s, so its own group of 64 is given), every Linear but lm_head.
DIR is the default model's directory (`pdserve prepare-model` prints it).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--schemes", default="W8A8,W4A16")
    args = parser.parse_args()

    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for scheme in args.schemes.split(","):
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype="bfloat16")
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        if scheme == "W4A16":
            weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                       group_size=64)
            modifier = QuantizationModifier(
                config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                ignore=["lm_head"])
        else:
            modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
        oneshot(model=model, recipe=modifier)
        out = args.out / scheme
        model.save_pretrained(out, save_compressed=True)
        tokenizer.save_pretrained(out)
        print(f"{scheme}: {out}", flush=True)


if __name__ == "__main__":
    main()
