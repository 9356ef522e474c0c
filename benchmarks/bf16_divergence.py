"""bfloat16 greedy output against transformers' in bf16, by vLLM's standard (benchmarks/closeness.py), over a
fixed set of chat prompts on the default model: where each first diverges, eager and compiled.

    .venv/bin/python benchmarks/bf16_divergence.py [--model DIR] [--tokens 48] [--compile-modes off,on]
        [--out benchmarks/results/bf16_divergence.md]
Each prompt is served alone (one request per forward). On a CPU without native bf16 this runs emulated and
slow, but the rounding it measures is the same.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.closeness import first_divergence, reference

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short Python function that reverses a string.",
    "What is 17 times 23?",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--compile-modes", default="off,on")
    parser.add_argument("--out", default="benchmarks/results/bf16_divergence.md")
    args = parser.parse_args()
    from llm_engine import EngineConfig, LLMEngine, SamplingParams
    from llm_engine.default_model import prepare_default_model
    from llm_engine.model_files import load_tokenizer

    torch.set_num_threads(1)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    tokenizer = load_tokenizer(model_dir)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for p in PROMPTS]
    expected = reference(model_dir, prompts, args.tokens, torch.bfloat16, "cpu")
    lines = [f"# bfloat16 greedy vs transformers bf16, {model_dir.name}, {args.tokens} tokens per prompt", "",
             f"Command: `.venv/bin/python benchmarks/bf16_divergence.py {' '.join(sys.argv[1:])}`", "",
             "| engine | first divergence per prompt (– : none) | identical | close (vLLM's standard) |",
             "|---|---|---:|---:|"]
    for mode in args.compile_modes.split(","):
        engine = LLMEngine(EngineConfig(str(model_dir), dtype="bfloat16", compile=mode,
                                        kv_cache_bytes=256 << 20))
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=True,
                                top_logprobs=5)
        rows = []
        for prompt, (ref, top) in zip(prompts, expected, strict=True):
            [done] = engine.generate([prompt], params)
            rows.append(first_divergence(list(done.output_token_ids),
                                         [{t for t, _ in s} for s in done.output_top_logprobs], ref, top))
        name = (f"{engine.compilation.mode} ({engine.compilation.body} body), decode attention "
                f"{engine.runner.decode_attention}")
        positions = ", ".join("–" if r["position"] is None else str(r["position"]) for r in rows)
        lines.append(f"| {name} | {positions} | {sum(r['position'] is None for r in rows)}/{len(rows)} | "
                     f"{sum(r['close'] for r in rows)}/{len(rows)} |")
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
