"""Engine speed against plain transformers, side by side in one run, one torch thread (not a test).

1. Decode tokens/s at batch 1, 8, 32: the engine's step() (scheduling, paged attention, sampling included)
   vs the bare transformers forward with its DynamicCache and SDPA attention (argmax only), same prompts.
2. 16 mixed-length requests (prompt and output lengths differ): the engine's continuous batching vs
   transformers `generate` one request at a time, and vs one padded `generate` batch.

    .venv/bin/python benchmarks/engine_bench.py [--model DIR] [--dtype float32|bfloat16] [--out FILE]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import platform
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.config import DTYPES
from llm_engine.default_model import prepare_default_model


def bare_decode_tps(model: torch.nn.Module, prompts: torch.Tensor, steps: int) -> float:
    """Decode tokens/s of the plain HF forward over DynamicCache, prefill excluded."""
    batch, length = prompts.shape
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        out = model(input_ids=prompts, cache=cache, use_cache=True)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        start = time.perf_counter()
        for step in range(steps):
            positions = torch.full((batch, 1), length + step)
            out = model(input_ids=next_ids, cache=cache, use_cache=True, position_ids=positions)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return batch * steps / (time.perf_counter() - start)


def engine_decode_tps(engine: LLMEngine, prompts: torch.Tensor, steps: int) -> float:
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for row in prompts.tolist():
        engine.add_request(row, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (and the first token) of every request, excluded from the timing
    start = time.perf_counter()
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += len(engine.step())
    elapsed = time.perf_counter() - start
    assert engine.block_pool.is_whole()
    return num_tokens / elapsed


def mixed_workload(
    trace: Path, scale: float, vocab: int, count: int = 16
) -> tuple[list[list[int]], list[int]]:
    """The first `count` requests of the Azure conversation trace, both lengths multiplied by `scale`."""
    if not trace.is_file():
        raise SystemExit(f"--trace: {trace} not found (the Azure conversation trace, shared/traces/)")
    with trace.open() as f:
        rows = list(itertools.islice(csv.DictReader(f), count))
    generator = torch.Generator().manual_seed(0)
    prompt_lens = [max(1, round(int(r["ContextTokens"]) * scale)) for r in rows]
    output_lens = [max(1, round(int(r["GeneratedTokens"]) * scale)) for r in rows]
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in prompt_lens]
    return prompts, output_lens


def hf_generate_sequential(model: torch.nn.Module, prompts: list[list[int]], output_lens: list[int]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, n in zip(prompts, output_lens, strict=True):
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return sum(output_lens) / (time.perf_counter() - start)


def hf_generate_padded(
    model: torch.nn.Module, prompts: list[list[int]], output_lens: list[int], pad_id: int
) -> float:
    # One left-padded batch runs until the longest request is done; only the requested tokens count.
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        n = max(output_lens)
        model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
        )
    return sum(output_lens) / (time.perf_counter() - start)


def engine_mixed(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> float:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(c.output_token_ids) for c in completions] == output_lens
    return sum(output_lens) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--trace", type=Path, default=Path(__file__).parents[2] / "shared/traces/azure_conv_2023.csv"
    )
    parser.add_argument(
        "--length-scale",
        type=float,
        default=0.25,
        help="multiply the trace's prompt and output lengths by this (2 cores, one thread)",
    )
    parser.add_argument("--out", default="benchmarks/results/engine.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_dir = args.model or str(prepare_default_model())
    config = EngineConfig(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        kv_cache_bytes=1 << 30,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
    )
    engine = LLMEngine(config)
    bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).to(args.device).eval()
    vocab = engine.spec.vocab_size
    lines = [
        f"# Engine benchmark ({datetime.now(UTC):%Y-%m-%d}, {platform.node()}, 1 torch thread)",
        "",
        f"Model `{Path(model_dir).name}`, {args.dtype}, {args.device}; prompt {args.prompt_len} tokens, "
        f"{args.steps} decode steps timed, median of {args.repeats}.",
        "Command: `.venv/bin/python benchmarks/engine_bench.py"
        + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
        + "`",
        "",
        "| batch | bare HF forward tok/s | engine tok/s | engine / bare |",
        "|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for batch in (1, 8, 32):
        prompts = torch.randint(
            0, vocab, (batch, args.prompt_len), generator=torch.Generator().manual_seed(batch)
        )
        bare_runs, engine_runs = [], []
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits both alike
            bare_runs.append(bare_decode_tps(bare, prompts.to(args.device), args.steps))
            engine_runs.append(engine_decode_tps(engine, prompts, args.steps))
        b, e = statistics.median(bare_runs), statistics.median(engine_runs)
        line = f"| {batch} | {b:.1f} | {e:.1f} | {e / b:.2f} |"
        print(line, flush=True)
        lines.append(line)
    prompts, output_lens = mixed_workload(args.trace, args.length_scale, vocab)
    prompt_lens = [len(p) for p in prompts]
    table = [
        "",
        f"16 mixed requests: the first 16 of the Azure conversation trace, lengths × {args.length_scale}: "
        f"prompts {min(prompt_lens)}–{max(prompt_lens)} tokens ({sum(prompt_lens)} in all), "
        f"outputs {min(output_lens)}–{max(output_lens)} tokens ({sum(output_lens)} in all); output tokens/s.",
        "",
        "| HF generate, one at a time | HF generate, one padded batch | engine | engine / one-at-a-time "
        "| engine / padded |",
        "|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(table), flush=True)
    sequential = hf_generate_sequential(bare, prompts, output_lens)
    padded = hf_generate_padded(bare, prompts, output_lens, pad_id=0)
    ours = engine_mixed(engine, prompts, output_lens)
    line = f"| {sequential:.1f} | {padded:.1f} | {ours:.1f} | {ours / sequential:.2f} | {ours / padded:.2f} |"
    print(line, flush=True)
    lines += [*table, line]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
