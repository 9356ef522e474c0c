"""Quantized checkpoints of the default model served through 1 prefill + 1 decode, held to vLLM's standard
against transformers running the same checkpoint, and what each scheme costs in quality.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_closeness.py [--schemes W8A8,W4A16] [--dtype bfloat16]
        [--prompts 20] [--max-tokens 32] [--out benchmarks/results/quant_closeness.md]
For each scheme (`pdserve quantize` of SmolLM2-135M-Instruct, cached with benchmarks/quant_step.py's models;
`--checkpoint NAME=DIR` adds one made elsewhere, such as llm-compressor's):
- closeness: a real `pdserve serve --prefill 1 --decode 1` answers 20 chat prompts greedily (top-5 logprobs);
  transformers (compressed-tensors' reading of the same checkpoint) generates the same prompts in float32 and
  in --dtype; per prompt, the first differing token and vLLM's verdict there (each side's token in the other's
  top-5);
- quality: transformers' mean negative log-likelihood per token (float32) of a fixed passage of English under
  the unquantized checkpoint and under each scheme: the scheme's own cost, whoever serves it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks.closeness import first_divergence, reference
from benchmarks.lm_eval_parity import free_port, pdserve
from benchmarks.quant_step import RESULTS, model_dirs, write_report

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one sentence.", "Write a haiku about rain.",
    "How many legs does a spider have?", "Name three primary colors.", "What does a CPU do?",
    "Give me a synonym for happy.", "Why is the sky blue?", "What is 12 times 12?",
    "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?", "What is an atom?",
    "Describe a cat in five words.", "What is the boiling point of water?", "Suggest a name for a dog.",
    "What is machine learning?", "List two fruits that are red.", "How do airplanes fly?",
    "What is the opposite of cold?", "Tell me a fun fact about the moon.",
]
PASSAGE = (
    "The river rose slowly through the night, and by morning the low fields along its banks were under "
    "water. Farmers who had lived there for generations knew the signs: the heavy rain in the hills, the "
    "brown colour of the current, the birds flying inland. They had moved their animals to higher ground the "
    "evening before, and now they stood at the edge of the flood, watching the water cover the roads they "
    "had walked all their lives. Nobody spoke much. When the sun came out in the afternoon, the children "
    "began to throw stones into the new lake, and their parents started to talk about the harvest, the "
    "repairs, and the long summer ahead."
)


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS[:count]]


def served(url: str, model: str, prompts: list[list[int]], max_tokens: int
           ) -> list[tuple[list[int], list[set[int]]]]:
    """Each prompt's greedy tokens and top-5 ids per step from /v1/completions (token ids in and out)."""
    outputs = []
    with httpx.Client(timeout=300) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "logprobs": 5, "return_tokens_as_token_ids": True}
            choice = client.post(f"{url}/v1/completions", json=body).raise_for_status().json()["choices"][0]
            logprobs = choice["logprobs"]
            tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            tops = [{int(t.removeprefix("token_id:")) for t in top} for top in logprobs["top_logprobs"]]
            outputs.append((tokens, tops))
    return outputs


def passage_nll(model_dir: Path) -> float:
    """transformers' mean NLL per token of PASSAGE, float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer(PASSAGE)["input_ids"]])
    with torch.inference_mode():
        return float(model(ids, labels=ids).loss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="W8A8,W4A16")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--models", type=Path, default=RESULTS / "quant_models")
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_closeness.md")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="also a checkpoint made elsewhere (llm-compressor's: "
                             "benchmarks/llmcompressor_checkpoints.py), named NAME in the table")
    args = parser.parse_args()
    schemes = [s for s in args.schemes.split(",") if s]
    dirs = model_dirs("smollm2", ["none", *schemes], args.models)
    for named in args.checkpoint:
        name, _, path = named.partition("=")
        dirs[name] = Path(path)
        schemes.append(name)
    prompts = chat_prompts(dirs["none"], args.prompts)
    nll = {scheme: passage_nll(path) for scheme, path in dirs.items()}
    lines = [f"# Quantized SmolLM2-135M-Instruct through 1 prefill + 1 decode ({args.dtype}), "
             f"{len(prompts)} chat prompts, {args.max_tokens} tokens", "",
             "| scheme | close to transformers fp32 | to transformers " + args.dtype + " | identical (fp32) "
             "| first difference (median step) | passage NLL / token (fp32) |",
             "|---|---:|---:|---:|---:|---:|",
             f"| unquantized | | | | | {nll['none']:.4f} |"]
    report: dict[str, Any] = {"nll": nll}
    for scheme in schemes:
        port = free_port()
        with pdserve(str(dirs[scheme]), port, dtype=args.dtype) as url:
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            ours = served(url, model, prompts, args.max_tokens)
        verdicts = {}
        for name, dtype in (("float32", torch.float32), (args.dtype, getattr(torch, args.dtype))):
            theirs = reference(dirs[scheme], prompts, args.max_tokens, dtype, "cpu")
            verdicts[name] = [first_divergence(o[0], o[1], t[0], t[1])
                              for o, t in zip(ours, theirs, strict=True)]
        fp32 = verdicts["float32"]
        positions = sorted(v["position"] for v in fp32 if v["position"] is not None)
        median = positions[len(positions) // 2] if positions else "—"
        lines.append(f"| {scheme} | {sum(v['close'] for v in fp32)}/{len(fp32)} | "
                     f"{sum(v['close'] for v in verdicts[args.dtype])}/{len(fp32)} | "
                     f"{sum(v['position'] is None for v in fp32)}/{len(fp32)} | {median} | {nll[scheme]:.4f} "
                     f"({nll[scheme] - nll['none']:+.4f}) |")
        report[scheme] = verdicts
    write_report(args.out, lines)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
