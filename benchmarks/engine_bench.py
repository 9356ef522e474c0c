"""Engine step time against the bare transformers forward, side by side in one run, 1 torch thread (no test).

1. Decode step time (ms) at each batch: one engine step() (schedule, attention metadata, paged attention,
   sampling, output objects) against one bare forward over transformers' DynamicCache with SDPA (argmax only),
   the two alternating step by step over the same prompts, so drift in the machine's load hits both alike.
2. Where the engine's decode step goes: the model body and lm_head are timed by wrapping their forwards;
   the rest of the step (scheduler, metadata, sampler, outputs) is "outside the forward".
3. Prefill of one fresh prompt of each --prefill-lens length: one engine step against one bare forward
   (logits of the last position only, as `generate` does).
4. --mixed: 16 mixed-length requests of the Azure trace, engine continuous batching vs HF generate.

--against TREE compares engines: each repeat runs 1-3 once per tree, in a subprocess whose PYTHONPATH is that
tree (e.g. `git archive <commit> llm_engine | tar -x -C /tmp/engine-base`), alternating which tree goes first.

    .venv/bin/python benchmarks/engine_bench.py [--against /tmp/engine-base] [--batches 1,16] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve()
THIS_TREE = HERE.parents[1]


def _timed(module: torch.nn.Module, sink: list[float]) -> None:
    """Record the wall time of every call of `module.forward` into `sink`."""
    forward = module.forward

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = forward(*args, **kwargs)
        sink.append(time.perf_counter() - start)
        return result

    module.forward = wrapper


def decode_steps(engine: Any, bare: Any, prompts: torch.Tensor, steps: int,
                 body: list[float], head: list[float]) -> dict[str, list[float]]:
    """Per-step seconds of the bare forward and the engine step, alternating; prefill excluded."""
    from transformers import DynamicCache

    from llm_engine import SamplingParams

    batch, length = prompts.shape
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for row in prompts.tolist():
        engine.add_request(row, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    result: dict[str, list[float]] = {"bare": [], "engine": [], "body": [], "head": []}
    with torch.inference_mode():
        cache = DynamicCache(config=bare.config)
        out = bare(input_ids=prompts, cache=cache, use_cache=True, logits_to_keep=1)
        next_ids = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        for step in range(steps):
            start = time.perf_counter()
            positions = torch.full((batch, 1), length + step)
            out = bare(input_ids=next_ids, cache=cache, use_cache=True, position_ids=positions)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            middle = time.perf_counter()
            body.clear()
            head.clear()
            engine.step()
            result["engine"].append(time.perf_counter() - middle)
            result["bare"].append(middle - start)
            result["body"].append(sum(body))
            result["head"].append(sum(head))
    assert not engine.has_unfinished() and engine.block_pool.is_whole()
    return result


def prefill_once(engine: Any, bare: Any, prompt: list[int]) -> dict[str, float]:
    """Seconds of one engine step prefilling `prompt` (first token sampled) and of one bare forward."""
    from llm_engine import SamplingParams

    with torch.inference_mode():
        start = time.perf_counter()
        bare(input_ids=torch.tensor([prompt]), logits_to_keep=1).logits[:, -1].argmax(-1)
        bare_s = time.perf_counter() - start
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    engine.step()
    engine_s = time.perf_counter() - start
    assert not engine.has_unfinished()
    return {"bare": bare_s, "engine": engine_s}


def measure(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One round of 1-3 against whichever llm_engine is importable; returns seconds, per step."""
    from transformers import AutoModelForCausalLM

    import llm_engine
    from llm_engine import EngineConfig, LLMEngine
    from llm_engine.config import DTYPES

    torch.set_num_threads(1)
    config = EngineConfig(args.model, dtype=args.dtype, device="cpu", kv_cache_bytes=1 << 30,
                          max_num_batched_tokens=max(2048, *args.prefill_lens), max_num_seqs=64)
    engine = LLMEngine(config)
    body: list[float] = []
    head: list[float] = []
    _timed(engine.runner.model.model, body)
    _timed(engine.runner.model.lm_head, head)
    bare = AutoModelForCausalLM.from_pretrained(args.model, dtype=DTYPES[args.dtype]).eval()
    vocab = engine.spec.vocab_size
    generator = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {"engine_file": llm_engine.__file__, "decode": {}, "prefill": {}}
    for batch in args.batches:
        prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator)
        steps = decode_steps(engine, bare, prompts, args.steps + args.warmup, body, head)
        result["decode"][batch] = {k: v[args.warmup:] for k, v in steps.items()}
    for length in args.prefill_lens:
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()  # fresh: no cache hit
        result["prefill"][length] = prefill_once(engine, bare, prompt)
    return result


def run_child(tree: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    command = [sys.executable, str(HERE), "--child", "--seed", str(seed), "--model", args.model,
               "--dtype", args.dtype, "--batches", ",".join(map(str, args.batches)),
               "--prefill-lens", ",".join(map(str, args.prefill_lens)), "--prompt-len", str(args.prompt_len),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["engine_file"].startswith(str(tree)):
        raise SystemExit(f"{tree}: imported {result['engine_file']} instead")
    return result


def _ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _spread(per_round: list[float]) -> str:
    """min–max over the rounds' medians, in ms: how noisy the figure is."""
    return f"{min(per_round) * 1e3:.1f}–{max(per_round) * 1e3:.1f}"


def _decode(rounds: list[dict[str, Any]], batch: int, field: str) -> list[float]:
    """Every timed step of every round."""
    return [x for r in rounds for x in r["decode"][str(batch)][field]]


def _decode_rounds(rounds: list[dict[str, Any]], batch: int, field: str) -> list[float]:
    """One median per round."""
    return [statistics.median(r["decode"][str(batch)][field]) for r in rounds]


def _prefill(rounds: list[dict[str, Any]], length: int, field: str) -> list[float]:
    return [r["prefill"][str(length)][field] for r in rounds]


def report(rounds: dict[str, list[dict[str, Any]]]) -> list[str]:
    names = list(rounds)
    first = rounds[names[0]][0]
    lines = [
        "Decode step, ms: median (min–max of the rounds' medians); engine / bare: median of the rounds' "
        "ratios (min–max); body / lm_head / outside: medians over steps, outside = step − body − lm_head.",
        "",
        "| batch | bare forward | " + " | ".join(f"engine {n}" for n in names) + " | "
        + " | ".join(f"{n} / bare" for n in names) + " | "
        + " | ".join(f"{n}: body / lm_head / outside (share)" for n in names) + " |",
        "|---:" * (2 + 3 * len(names)) + "|",
    ]
    for batch in first["decode"]:
        bare = [x for n in names for x in _decode(rounds[n], batch, "bare")]
        bare_rounds = [x for n in names for x in _decode_rounds(rounds[n], batch, "bare")]
        cells = [f"{batch}", f"{_ms(bare):.1f} ({_spread(bare_rounds)})"]
        ratios, parts = [], []
        for n in names:
            engine, body, head = (_decode(rounds[n], batch, f) for f in ("engine", "body", "head"))
            outside = [e - b - h for e, b, h in zip(engine, body, head, strict=True)]
            cells.append(f"{_ms(engine):.1f} ({_spread(_decode_rounds(rounds[n], batch, 'engine'))})")
            # Each round's engine over the same round's bare forward: a pair shares the machine's load.
            pairs = [e / b for e, b in zip(_decode_rounds(rounds[n], batch, "engine"),
                                           _decode_rounds(rounds[n], batch, "bare"), strict=True)]
            ratios.append(f"{statistics.median(pairs):.3f} ({min(pairs):.3f}–{max(pairs):.3f})")
            parts.append(f"{_ms(body):.1f} / {_ms(head):.1f} / {_ms(outside):.2f} "
                         f"({statistics.median(outside) / statistics.median(engine) * 100:.1f}%)")
        lines.append("| " + " | ".join(cells + ratios + parts) + " |")
    lines += ["", "Prefill of one fresh prompt, ms: median (min–max over rounds).", "",
              "| prompt tokens | bare forward | " + " | ".join(f"engine {n}" for n in names) + " |",
              "|---:" * (2 + len(names)) + "|"]
    for length in first["prefill"]:
        bare = [x for n in names for x in _prefill(rounds[n], length, "bare")]
        cells = [f"{length}", f"{_ms(bare):.0f} ({_spread(bare)})"]
        for n in names:
            engine = _prefill(rounds[n], length, "engine")
            cells.append(f"{_ms(engine):.0f} ({_spread(engine)})")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def mixed_table(args: argparse.Namespace) -> list[str]:
    """16 requests of the Azure conversation trace: engine continuous batching vs HF generate."""
    import csv
    import itertools

    from transformers import AutoModelForCausalLM

    from llm_engine import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(1)
    if not args.trace.is_file():
        raise SystemExit(f"--trace: {args.trace} not found (the Azure conversation trace, shared/traces/)")
    with args.trace.open() as f:
        rows = list(itertools.islice(csv.DictReader(f), 16))
    engine = LLMEngine(EngineConfig(args.model, dtype=args.dtype, kv_cache_bytes=1 << 30,
                                    max_num_batched_tokens=2048, max_num_seqs=64))
    bare = AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.config.torch_dtype).eval()
    generator = torch.Generator().manual_seed(0)
    scale = args.length_scale
    output_lens = [max(1, round(int(r["GeneratedTokens"]) * scale)) for r in rows]
    prompts = [torch.randint(0, engine.spec.vocab_size, (max(1, round(int(r["ContextTokens"]) * scale)),),
                             generator=generator).tolist() for r in rows]
    start = time.perf_counter()
    with torch.inference_mode():
        for prompt, n in zip(prompts, output_lens, strict=True):
            bare.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    sequential = sum(output_lens) / (time.perf_counter() - start)
    start = time.perf_counter()
    done = engine.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                                     for n in output_lens])
    ours = sum(output_lens) / (time.perf_counter() - start)
    assert [len(c.output_token_ids) for c in done] == output_lens
    return [
        f"16 mixed requests (the first 16 of the Azure conversation trace, lengths × {scale}: prompts "
        f"{sum(map(len, prompts))} tokens, outputs {sum(output_lens)} tokens), output tokens/s:", "",
        "| HF generate, one at a time | engine | engine / HF |", "|---:|---:|---:|",
        f"| {sequential:.1f} | {ours:.1f} | {ours / sequential:.2f} |",
    ]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", type=ints, default=[1, 16])
    parser.add_argument("--prefill-lens", type=ints, default=[256, 1024])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch and round")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps run first and not counted")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (per tree)")
    parser.add_argument("--against", type=Path, default=None, help="a tree holding an earlier llm_engine/")
    parser.add_argument("--mixed", action="store_true", help="also 4. (this tree only)")
    parser.add_argument("--trace", type=Path, default=THIS_TREE.parent / "shared/traces/azure_conv_2023.csv")
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/engine_step.md")
    args = parser.parse_args()
    if not args.child:
        sys.path.insert(0, str(THIS_TREE))  # the parent (and --mixed) use this tree's engine
    if args.model is None:
        from llm_engine.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    if args.child:
        print(json.dumps(measure(args, args.seed)))
        return
    trees = {"before": args.against.resolve()} if args.against else {}
    trees["after" if args.against else "this"] = THIS_TREE
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for index in range(args.repeats):
        order = list(trees) if index % 2 == 0 else list(reversed(trees))  # neither tree always goes first
        for name in order:
            rounds[name].append(run_child(trees[name], args, seed=index))
            print(f"round {index + 1}/{args.repeats} {name}: done", file=sys.stderr, flush=True)
    trees_text = ", ".join(f"{n} = `{p}`" for n, p in trees.items())
    lines = [
        f"# Engine step time ({datetime.now(UTC):%Y-%m-%d}, {platform.node()}, {cpu_name()}, 1 torch thread)",
        "",
        f"Model `{Path(args.model).name}`, {args.dtype}, cpu. Trees: {trees_text}. {args.repeats} rounds per "
        f"tree, alternating; decode: prompt {args.prompt_len} tokens, {args.steps} steps per round after "
        f"{args.warmup} warm-up steps, median over all steps (min–max of the rounds' medians).",
        f"Command: `.venv/bin/python benchmarks/engine_bench.py {' '.join(sys.argv[1:])}`", "",
        *report(rounds),
    ]
    if args.mixed:
        lines += ["", *mixed_table(args)]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
