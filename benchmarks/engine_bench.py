"""(Over 300 lines: one script a user runs; its three contenders are measured in one loop.)

Engine step time beside the bare transformers forward and vLLM's CPU engine, side by side in one run.

For each --dtypes × --threads setting, every tree (this one, and --against an earlier one) runs in a
subprocess whose PYTHONPATH is that tree, rounds alternating which goes first, and vLLM's engine runs in its
own venv (benchmarks/vllm_engine_steps.py; --no-vllm to skip). Rows:
- prefill of one fresh prompt of each --prefill-lens length: one engine step, one bare forward (logits of the
  last position only, as `generate` does), vLLM's time to first token of a max_tokens=1 request;
- decode step at each --decode batch@context: one engine step() (schedule, metadata, paged attention,
  sampling, outputs) against one bare forward over transformers' DynamicCache with SDPA (argmax only), the
  two alternating step by step, so drift in the machine's load hits both alike.
Beside the times, what the hardware allows:
- prefill rows are GEMM-bound: "GEMM share" = the same linears (the engine's own modules, on the kernel it
  chose) run standalone on [tokens, in] inputs / the engine's whole step. 1.0 would be a step that is only
  its GEMMs at their standalone speed;
- decode rows are memory-bound: "of bandwidth" = (weight bytes + KV bytes the step reads) / step time, over
  the machine's copy bandwidth at the same thread count (a torch copy of 512 MiB: read + write).

    .venv/bin/python benchmarks/engine_bench.py [--against /tmp/engine-base] [--dtypes float32,bfloat16]
        [--threads 1,2] [--repeats 3] [--out benchmarks/results/engine_step.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
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


def decode_steps(engine: Any, bare: Any, prompts: torch.Tensor, steps: int) -> dict[str, list[float]]:
    """Per-step seconds of the bare forward and the engine step, alternating; prefill excluded."""
    from transformers import DynamicCache

    from llm_engine import SamplingParams

    batch, length = prompts.shape
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for row in prompts.tolist():
        engine.add_request(row, params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    result: dict[str, list[float]] = {"bare": [], "engine": []}
    with torch.inference_mode():
        cache = DynamicCache(config=bare.config)
        next_ids = None
        for start in range(0, batch, 16):  # the bare prefill in slices of 16 rows: bounded memory
            out = bare(input_ids=prompts[start:start + 16], use_cache=True, logits_to_keep=1)
            rows = out.logits[:, -1].argmax(-1, keepdim=True)
            next_ids = rows if next_ids is None else torch.cat([next_ids, rows])
            if start == 0:
                cache = out.cache
            else:
                for layer, (k, v) in enumerate(_layers_kv(out.cache)):
                    cache.layers[layer].keys = torch.cat([cache.layers[layer].keys, k])
                    cache.layers[layer].values = torch.cat([cache.layers[layer].values, v])
        for step in range(steps):
            start_s = time.perf_counter()
            positions = torch.full((batch, 1), length + step)
            out = bare(input_ids=next_ids, cache=cache, use_cache=True, position_ids=positions)
            next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            middle = time.perf_counter()
            engine.step()
            result["engine"].append(time.perf_counter() - middle)
            result["bare"].append(middle - start_s)
    assert not engine.has_unfinished() and engine.block_pool.is_whole()
    return result


def _layers_kv(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


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


def standalone_linears(model: torch.nn.Module, num_tokens: int, dtype: torch.dtype) -> float:
    """Seconds of one pass of the model's own linear layers (as the engine runs them) over num_tokens rows;
    the lm_head once, for the sampled row."""
    head = getattr(model, "lm_head", None)
    layers = [m for m in model.modules() if hasattr(m, "in_features") and m is not head
              and not list(m.children())]
    inputs = {n: torch.randn(num_tokens, n, dtype=dtype) for n in {m.in_features for m in layers}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(3):
            start = time.perf_counter()
            for layer in layers:
                layer(inputs[layer.in_features])
            if head is not None:
                head(inputs[head.in_features][:1])
            best = min(best, time.perf_counter() - start)
    return best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: every parameter but the embedding table (a row lookup)."""
    embedding = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding)
    if model.get_output_embeddings().weight is embedding:  # a tied lm_head reads the whole matrix
        total += embedding.numel() * embedding.element_size()
    return total


def measure(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """One round against whichever llm_engine is importable; returns seconds."""
    from transformers import AutoModelForCausalLM

    import llm_engine
    from llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    decode_shapes = [tuple(map(int, x.split("@"))) for x in args.decode]
    tokens_needed = max(b * (c + args.steps + args.warmup + 16) for b, c in decode_shapes)
    bare = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
    # KV bytes per token from the checkpoint's shape: an older tree's engine is measured by the same script.
    spec_bytes = 2 * bare.config.num_hidden_layers * bare.config.num_key_value_heads * (
        bare.config.hidden_size // bare.config.num_attention_heads) * dtype.itemsize
    config = EngineConfig(args.model, dtype=args.dtype, device="cpu",
                          kv_cache_bytes=max(1 << 30, tokens_needed * spec_bytes * 11 // 10),
                          max_num_batched_tokens=max(2048, *args.prefill_lens), max_num_seqs=64)
    load_start = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - load_start
    kernel = getattr(engine, "linear_kernel", None)
    compilation = getattr(engine, "compilation", None)
    vocab = engine.spec.vocab_size
    generator = torch.Generator().manual_seed(seed)
    result: dict[str, Any] = {
        "engine_file": llm_engine.__file__, "decode": {}, "prefill": {}, "gemm": {},
        "kernel": None if kernel is None
        else f"{getattr(kernel, 'label', kernel.kernel.value)} ({kernel.reason})",
        "weight_bytes": weight_bytes(bare), "kv_bytes_per_token": spec_bytes, "load_s": load_s,
        "compile": "eager (no lean body in this tree)" if compilation is None
        else f"{compilation.mode} ({compilation.reason})",
        "decode_attention": getattr(engine.runner, "decode_attention", "?"),
    }
    for batch, context in decode_shapes:
        prompts = torch.randint(0, vocab, (batch, context), generator=generator)
        steps = decode_steps(engine, bare, prompts, args.steps + args.warmup)
        result["decode"][f"{batch}@{context}"] = {k: v[args.warmup:] for k, v in steps.items()}
    for length in args.prefill_lens:
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()  # fresh: no cache hit
        prefill_once(engine, bare, prompt)  # warm-up: the first forward of a length builds kernels
        prompt = torch.randint(0, vocab, (length,), generator=generator).tolist()
        result["prefill"][str(length)] = prefill_once(engine, bare, prompt)
        result["gemm"][str(length)] = standalone_linears(engine.runner.model, length, dtype)
    return result


def copy_bandwidth(threads: int) -> float:
    """Bytes per second a torch copy of 512 MiB moves (read + write), at `threads` threads."""
    torch.set_num_threads(threads)
    src = torch.ones(128 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def run_child(tree: Path, mode: str, args: argparse.Namespace, dtype: str, threads: int, seed: int,
              cache_dir: Path) -> dict[str, Any]:
    command = [sys.executable, str(HERE), "--child", "--seed", str(seed), "--model", args.model,
               "--dtypes", dtype, "--threads", str(threads), "--decode", ",".join(args.decode),
               "--prefill-lens", ",".join(map(str, args.prefill_lens)),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    # --compile by environment (a tree from before the flag ignores it); one inductor cache per setting, new
    # for the run: a compiled engine's first round is a cold start, its later rounds warm ones.
    env = {**os.environ, "PYTHONPATH": str(tree), "PDSERVE_COMPILE": mode,
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree} ({dtype}, {threads} threads) failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["engine_file"].startswith(str(tree)):
        raise SystemExit(f"{tree}: imported {result['engine_file']} instead")
    return result


def _med(values: list[float]) -> float:
    return statistics.median(values)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if seconds < 1 else f"{seconds * 1e3:.0f}"


def _spread(values: list[float]) -> str:
    return f"{min(values) * 1e3:.1f}–{max(values) * 1e3:.1f}"


def report(rounds: dict[str, list[dict[str, Any]]], vllm: dict[str, Any] | None, bandwidth: float,
           ) -> list[str]:
    """One table: rows prefill and decode; per tree its median (min–max of rounds), vLLM's, the ratios."""
    names = list(rounds)
    ours = names[-1]
    first = rounds[ours][0]
    head = ["row", "bare forward", *(f"engine {n}" for n in names)]
    head += ["vLLM", f"{ours} / vLLM"] if vllm else []
    head += [f"{ours} / bare", "GEMM share (prefill) · of bandwidth (decode)"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]

    def cells(kind: str, key: str, per_round: dict[str, list[float]], bare: list[float],
              vllm_values: list[float] | None, extra: str) -> None:
        row = [f"{kind} {key}", f"{_ms(_med(bare))} ({_spread(bare)})"]
        row += [f"{_ms(_med(per_round[n]))} ({_spread(per_round[n])})" for n in names]
        if vllm:
            row += [f"{_ms(_med(vllm_values))} ({_spread(vllm_values)})" if vllm_values else "–",
                    f"{_med(per_round[ours]) / _med(vllm_values):.2f}" if vllm_values else "–"]
        row += [f"{_med(per_round[ours]) / _med(bare):.2f}", extra]
        lines.append("| " + " | ".join(row) + " |")

    for length in first["prefill"]:
        per_round = {n: [r["prefill"][length]["engine"] for r in rounds[n]] for n in names}
        bare = [r["prefill"][length]["bare"] for n in names for r in rounds[n]]
        gemm = _med([r["gemm"][length] for r in rounds[ours]])
        share = f"{gemm / _med(per_round[ours]):.2f}"
        cells("prefill", length, per_round, bare, (vllm or {}).get("prefill", {}).get(length), share)
    for key in first["decode"]:
        batch, context = map(int, key.split("@"))
        per_round = {n: [_med(r["decode"][key]["engine"]) for r in rounds[n]] for n in names}
        bare = [_med(r["decode"][key]["bare"]) for n in names for r in rounds[n]]
        read = first["weight_bytes"] + batch * context * first["kv_bytes_per_token"]
        share = f"{read / _med(per_round[ours]) / bandwidth:.2f}"
        cells("decode", key, per_round, bare, (vllm or {}).get("decode", {}).get(key), share)
    return lines


def startup(rounds: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each engine's load time per round (weights, linear probe, compile and warm-up; the first round of a
    compiled engine starts with an empty inductor cache, later ones with a warm one) and what it ran."""
    lines = ["Engine start (LLMEngine construction), s per round: "]
    for name, per_round in rounds.items():
        loads = ", ".join(f"{r.get('load_s', float('nan')):.1f}" for r in per_round)
        lines.append(f"- {name}: {loads}; body {per_round[0].get('compile', '?')}; decode attention "
                     f"{per_round[0].get('decode_attention', '?')}")
    return lines


def _vllm_notes(vllm: dict[str, Any]) -> str:
    """vLLM's version, kernels and compilation, as its run reported them."""
    gemms = sorted(set(dict(vllm.get("gemm", {})).values()))
    return (f"vLLM {vllm.get('vllm_version', '?')}: GEMMs {', '.join(gemms) or '?'}; attention "
            f"{', '.join(vllm.get('attention_backend', [])) or '?'}; torch.compile mode "
            f"{vllm.get('compilation_mode', '?')}; threads bound to cores {vllm.get('affinity', '?')}.")


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", type=words, default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=ints, default=[1, 2])
    # 64@2048 (131k tokens of context to prefill first, for both engines) is left to a run of its own.
    parser.add_argument("--decode", type=words, default=["1@256", "16@256", "64@256", "1@2048", "16@2048"],
                        help="decode rows, batch@context")
    parser.add_argument("--prefill-lens", type=ints, default=[256, 1024, 2048])
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per row and round")
    parser.add_argument("--warmup", type=int, default=2, help="decode steps run first and not counted")
    parser.add_argument("--repeats", type=int, default=2, help="rounds (per tree)")
    parser.add_argument("--against", type=Path, default=None, help="a tree holding an earlier llm_engine/")
    parser.add_argument("--compile-modes", type=words, default=["on", "auto"],
                        help="--compile values each tree runs with, side by side (eager vs compiled)")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM's column")
    parser.add_argument("--vllm-venv", type=Path, default=Path("/work/vllm-venv"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/engine_step.md")
    args = parser.parse_args()
    if not args.child:
        sys.path.insert(0, str(THIS_TREE))
    if args.model is None:
        from llm_engine.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    if args.child:
        args.dtype, args.threads = args.dtypes[0], args.threads[0]
        print(json.dumps(measure(args, args.seed)))
        return
    from benchmarks.vllm_baseline import measure_vllm_engine
    from llm_engine.hardware import cpu_flags

    tree_paths = {"before": args.against.resolve()} if args.against else {}
    tree_paths["after" if args.against else "this"] = THIS_TREE
    # Engines side by side: each tree with each --compile mode ("this off", "this on", ...).
    trees = {(f"{name} {mode}" if len(args.compile_modes) > 1 else name): (path, mode)
             for name, path in tree_paths.items() for mode in args.compile_modes}
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    lines = [
        f"# Engine step time ({datetime.now(UTC):%Y-%m-%d}, {platform.node()}, {cpu_name()})", "",
        f"CPU flags (vector/matrix): {' '.join(flags)}.",
        f"Model `{Path(args.model).name}`, cpu. "
        f"Engines: {', '.join(f'{n} = `{p}` --compile {m}' for n, (p, m) in trees.items())}. "
        f"{args.repeats} rounds per tree, alternating which goes first; decode: {args.steps} steps per round "
        f"after {args.warmup} warm-up steps, median of each round (figures: median of the rounds' medians, "
        "min–max in brackets); prefill: one step per round after a warm-up prompt of the same length.",
        f"Command: `.venv/bin/python benchmarks/engine_bench.py {' '.join(sys.argv[1:])}`", "",
    ]
    results: dict[str, Any] = {}
    for dtype in args.dtypes:
        for threads in args.threads:
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
            cache_dir = Path(tempfile.mkdtemp(prefix="pdserve-inductor-"))
            for index in range(args.repeats):
                order = list(trees) if index % 2 == 0 else list(reversed(trees))
                for name in order:
                    path, mode = trees[name]
                    rounds[name].append(run_child(path, mode, args, dtype, threads, index, cache_dir))
                    print(f"{dtype} {threads}t round {index + 1}/{args.repeats} {name}: done",
                          file=sys.stderr, flush=True)
            vllm = None
            vllm_failure = ""
            if not args.no_vllm:
                try:
                    vllm = measure_vllm_engine(Path(args.model), dtype, threads, args.repeats,
                                               venv=args.vllm_venv,
                                               extra_args=["--decode-shapes", ",".join(args.decode),
                                                           "--prefill-lens", *map(str, args.prefill_lens)])
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:  # our columns still stand
                    tail = " ".join(str(error).splitlines()[-3:])[-400:]
                    vllm_failure = f" vLLM's engine did not run here: {tail}"
                    print(vllm_failure, file=sys.stderr)
            bandwidth = copy_bandwidth(threads)
            ours = rounds[list(trees)[-1]][0]
            lines += [f"## {dtype}, {threads} thread{'s' if threads > 1 else ''}", "",
                      f"Our linears: {ours['kernel']}. Copy bandwidth at {threads} thread(s): "
                      f"{bandwidth / 1e9:.1f} GB/s."
                      + (f" {_vllm_notes(vllm)}" if vllm else vllm_failure), "",
                      *report(rounds, vllm, bandwidth), "", *startup(rounds), ""]
            results[f"{dtype}/{threads}"] = {"rounds": rounds, "vllm": vllm, "bandwidth": bandwidth}
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    Path(args.out).with_suffix(".json").write_text(json.dumps(results))
    print(f"\nwritten to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
