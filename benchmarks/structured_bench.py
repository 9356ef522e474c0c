"""What a JSON schema costs the engine: decode tokens/s with and without `response_format`'s grammar, and the
grammar mask's own time per step, on the default model (SmolLM2-135M, real weights) in the engine alone.

Each repeat runs the same --batch chat prompts twice, alternating which goes first: plain (ignore_eos, as many
tokens as the structured run produced on average, so both decode the same lengths) and with the schema
(greedy; generation ends at the grammar's end). tokens/s = output tokens / wall time of the whole generate().
The mask time is GrammarMask's own clock (fill the rows' bitmasks + apply them), per forward that masked any
row and per masked row. Medians over --repeats.

    .venv/bin/python benchmarks/structured_bench.py [--batch 4] [--repeats 3] [--threads 1]
        [--out benchmarks/results/structured.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "city", "age", "hobbies"],
    "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 40},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "hobbies": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 30}}},
}
QUESTIONS = ["Invent a person who lives in Paris.", "Describe a fictional engineer from Oslo.",
             "Make up a retired teacher.", "Create a character for a novel set in Rome.",
             "Describe a chef from Lyon.", "Invent a student in Tokyo.", "Describe a pilot.",
             "Make up a poet."]


def run(engine: Any, prompts: list[list[int]], params: Any) -> tuple[float, int, int, int, float]:
    """(seconds, output tokens, forwards that masked, rows masked, mask seconds) of one generate()."""
    mask = engine.runner.grammar_mask
    before = (mask.num_masked_steps, mask.num_masked_rows, mask.mask_seconds)
    started = time.perf_counter()
    completions = engine.generate(prompts, params)
    seconds = time.perf_counter() - started
    num_tokens = sum(len(c.output_token_ids) for c in completions)
    return (seconds, num_tokens, mask.num_masked_steps - before[0], mask.num_masked_rows - before[1],
            mask.mask_seconds - before[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", default="benchmarks/results/structured.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from llm_engine import EngineConfig, LLMEngine, SamplingParams
    from llm_engine.default_model import prepare_default_model
    from llm_engine.structured import GrammarSpec

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=256 << 20))
    prompts = [list(tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{q} Answer in JSON with name, city, age and hobbies."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)) for q in QUESTIONS[: args.batch]]
    structured = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                grammar=GrammarSpec.of_schema(SCHEMA))
    engine.generate(prompts, structured)  # warm: compile the grammar, load llguidance, first forwards
    rows: dict[str, list[float]] = {"plain tok/s": [], "schema tok/s": [], "mask ms/step": [],
                                    "mask ms/row": [], "step ms": []}
    for repeat in range(args.repeats):
        seconds, num_tokens, num_steps, num_rows, mask_s = run(engine, prompts, structured)
        mean_len = max(1, round(num_tokens / len(prompts)))
        plain = SamplingParams(max_tokens=mean_len, temperature=0, ignore_eos=True)
        plain_seconds, plain_tokens, _, _, _ = run(engine, prompts, plain)
        if repeat % 2:  # alternate the order, so drift in the machine's load hits both alike
            seconds, num_tokens, num_steps, num_rows, mask_s = run(engine, prompts, structured)
        rows["schema tok/s"].append(num_tokens / seconds)
        rows["plain tok/s"].append(plain_tokens / plain_seconds)
        rows["mask ms/step"].append(1000 * mask_s / max(1, num_steps))
        rows["mask ms/row"].append(1000 * mask_s / max(1, num_rows))
        rows["step ms"].append(1000 * seconds / max(1, num_steps))
        print(f"repeat {repeat}: plain {plain_tokens / plain_seconds:6.1f} tok/s  schema "
              f"{num_tokens / seconds:6.1f} tok/s ({num_tokens} tokens, {num_steps} masked forwards)  mask "
              f"{rows['mask ms/step'][-1]:.3f} ms/forward, {rows['mask ms/row'][-1]:.3f} ms/row", flush=True)
    medians = {k: statistics.median(v) for k, v in rows.items()}
    lines = [
        "# Structured outputs: cost of a JSON schema in the engine",
        "",
        f"`benchmarks/structured_bench.py`, {datetime.now(UTC):%Y-%m-%d}, {platform.processor() or 'cpu'}, "
        f"SmolLM2-135M float32, {args.threads} thread(s), batch {args.batch}, greedy, grammar engine "
        f"llguidance; medians of {args.repeats} repeats.",
        "",
        "| plain tok/s | with schema tok/s | ratio | mask ms per forward | mask ms per row "
        "| step ms (schema) |",
        "|---|---|---|---|---|---|",
        f"| {medians['plain tok/s']:.1f} | {medians['schema tok/s']:.1f} | "
        f"{medians['schema tok/s'] / medians['plain tok/s']:.3f} | {medians['mask ms/step']:.3f} | "
        f"{medians['mask ms/row']:.3f} | {medians['step ms']:.1f} |",
        "",
        f"Schema: `{json.dumps(SCHEMA)}`",
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[4:7]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
