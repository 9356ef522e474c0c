# mypy: ignore-errors
# (Runs in vLLM's own venv, /work/vllm-venv: neither vllm nor its types exist in pdserve's.)
"""vLLM's CPU engine, one step at a time: the baseline for pdserve's engine step times (issue 18).

Run with vLLM's venv (see benchmarks/vllm_baseline.py for its recipe); imports nothing from pdserve:

    /work/vllm-venv/bin/python benchmarks/vllm_engine_steps.py --model DIR --dtype bfloat16 --threads 1

What is timed: `LLMEngine.step()` with the engine core and its worker in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the "uni" executor), so one call is exactly one
schedule → execute → update, with no IPC to another process in it (plus output processing of a few
requests, without detokenization).
- prefill L: one fresh prompt of L random tokens, max_tokens=1, prefix caching off; the time of the single
  step that prefills it and samples its first token (L ≤ max_num_batched_tokens, so one step).
- decode B@C: B requests of C random prompt tokens (ignore_eos), stepped until every one is decoding; then
  `--steps` timed steps per repeat, each a pure decode step of all B (checked); one median per repeat.
  The repeats follow each other on the same batch (the context grows by `--steps` per repeat).

Thread binding: vLLM binds OpenMP threads only in the worker processes its "mp" executor spawns (from
VLLM_CPU_OMP_THREADS_BIND, through GOMP_CPU_AFFINITY and OMP_NUM_THREADS, with torch's libgomp and vLLM's
tcmalloc, when its wheel ships one (0.32.0's does not), in LD_PRELOAD). In-process there is no such spawn, so
this script re-executes itself once with exactly that environment (cores 0..threads-1), before torch or vllm
are imported. VLLM_CPU_KVCACHE_SPACE is sized to the largest decode batch (at least 4 GiB).

vLLM logs to stdout (and stderr); the last stdout line is the result, one JSON object:
    {"prefill": {"256": [s, ...]}, "decode": {"1@256": [s/step per repeat]}, "vllm_version", "threads",
     "dtype", "gemm": {layer kind: path}, "attention_backend", ...}
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path

CHILD_FLAG = "PDSERVE_VLLM_STEPS_CHILD"  # set in the re-executed process
PREFILL_LENS = (256, 1024, 2048)
DECODE_SHAPES = ("1@256", "16@256", "64@256", "1@2048", "16@2048", "64@2048")
NUM_WARMUP_DECODE_STEPS = 2
MAX_MODEL_LEN = 4096
MAX_BATCHED_TOKENS = 4096  # tokens per step (vLLM's default for the LLM class on CPU), set explicitly


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # finds without importing
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed in {sys.executable}'s environment")
    return Path(next(iter(spec.submodule_search_locations)))


def bound_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """The environment vLLM's mp executor would give its worker, on cores 0..threads-1 (see the docstring)."""
    torch_dir, vllm_dir = _package_dir("torch"), _package_dir("vllm")
    gomp = sorted(glob.glob(str(torch_dir.parent / "torch.libs" / "libgomp*.so*")))
    gomp += sorted(glob.glob(str(torch_dir / "lib" / "libgomp*.so*")))
    tcmalloc = sorted(glob.glob(str(vllm_dir / "libs" / "libtcmalloc_minimal*.so*")))
    tcmalloc += sorted(glob.glob(str(vllm_dir / "libs" / "libtcmalloc.so*")))
    preload = [p for p in (tcmalloc[:1] + gomp[:1])]
    cores = list(range(threads))
    return {
        CHILD_FLAG: "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",  # for the record
        "OMP_NUM_THREADS": str(threads),
        "GOMP_CPU_AFFINITY": " ".join(map(str, cores)),
        "LD_PRELOAD": ":".join(preload),
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }


def decode_tokens_bound(batch: int, context: int, num_steps: int, repeats: int) -> int:
    """Tokens a decode-shape request may generate: the timed and warm-up steps, plus one per step that
    prefills the batch's later prompts (MAX_BATCHED_TOKENS per step) after its own prefill."""
    return NUM_WARMUP_DECODE_STEPS + num_steps * repeats + batch * context // MAX_BATCHED_TOKENS + 4


def kv_cache_gib(model_dir: Path, dtype: str, decode_shapes: list[tuple[int, int]], num_steps: int,
                 repeats: int) -> int:
    """GiB of KV cache that holds the largest decode batch (and a 2048 prefill), with slack; at least 4."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    bytes_per_token = (
        config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim
        * (4 if dtype == "float32" else 2)
    )
    tokens = max(
        [max(PREFILL_LENS) + 64]
        + [b * (c + decode_tokens_bound(b, c, num_steps, repeats) + 16) for b, c in decode_shapes]
    )
    return max(4, math.ceil(tokens * bytes_per_token * 1.15 / 2**30))


def describe_model(model) -> dict[str, object]:
    """Which GEMM each linear layer kind dispatched to, and the attention backend (run inside the worker)."""
    gemm: dict[str, str] = {}
    backends: set[str] = set()
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is not None:
            names = set(getattr(getattr(linear, "__code__", None), "co_names", ()))
            kind = (
                "oneDNN onednn_mm (prepacked)" if "onednn_mm" in names
                else "sgl weight_packed_linear_cpu (AMX brgemm)" if "weight_packed_linear_cpu" in names
                else "zentorch" if "zentorch" in names
                else "torch F.linear" if "linear" in names
                else getattr(linear, "__name__", repr(linear))
            )
            gemm[name.split(".")[-1]] = kind
        backend = getattr(module, "attn_backend", None)
        if backend is not None:
            backends.add(backend.get_name())
    return {"gemm": gemm, "attention_backend": sorted(backends)}


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [rng.randrange(100, vocab_size) for _ in range(length)]}


def measure_prefill(engine, params_cls, rng, vocab_size: int, length: int, repeats: int) -> list[float]:
    """Seconds of the one step that prefills a fresh `length`-token prompt, per repeat (after a warm-up)."""
    seconds = []
    for repeat in range(repeats + 1):
        params = params_cls(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        request_id = f"prefill-{length}-{repeat}"
        engine.add_request(request_id, random_prompt(rng, length, vocab_size), params)
        start = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - start
        if not (len(outputs) == 1 and outputs[0].finished) or engine.has_unfinished_requests():
            raise RuntimeError(f"prefill of {length} took more than one step")
        if repeat:  # the first is the warm-up
            seconds.append(elapsed)
    return seconds


def measure_decode(engine, params_cls, rng, vocab_size: int, batch: int, context: int, num_steps: int,
                   repeats: int) -> list[float]:
    """Median seconds per decode step of `batch` requests at `context`, one per repeat."""
    # Requests prefilled first decode while the others prefill: leave them room (all are aborted at the end).
    max_tokens = min(MAX_MODEL_LEN - context - 1, decode_tokens_bound(batch, context, num_steps, repeats))
    params = params_cls(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    request_ids = [f"decode-{batch}@{context}-{i}" for i in range(batch)]
    for request_id in request_ids:
        engine.add_request(request_id, random_prompt(rng, context, vocab_size), params)
    decoding: set[str] = set()
    while len(decoding) < batch:  # prefill steps (chunked, batched as the scheduler likes)
        decoding.update(output.request_id for output in engine.step())
    for _ in range(NUM_WARMUP_DECODE_STEPS):
        engine.step()
    medians = []
    for _ in range(repeats):
        seconds = []
        for _ in range(num_steps):
            start = time.perf_counter()
            outputs = engine.step()
            seconds.append(time.perf_counter() - start)
            if len(outputs) != batch:
                raise RuntimeError(f"decode {batch}@{context}: a step produced {len(outputs)} tokens")
        medians.append(statistics.median(seconds))
    engine.abort_request(request_ids)
    while engine.has_unfinished_requests():
        engine.step()
    return medians


def parse_shapes(text: str) -> list[tuple[int, int]]:
    return [(int(b), int(c)) for b, c in (item.split("@") for item in text.split(",") if item)]


def run(args: argparse.Namespace) -> dict[str, object]:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    model_dir = Path(args.model)
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(
        model=str(model_dir),
        dtype=args.dtype,
        max_model_len=MAX_MODEL_LEN,
        enable_prefix_caching=False,  # every prompt is prefilled in full, as a fresh one would be
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        seed=0,
    )
    engine = llm.llm_engine
    described = engine.apply_model(describe_model)[0]
    rng = random.Random(0)
    prefill = {
        str(length): measure_prefill(engine, SamplingParams, rng, vocab_size, length, args.repeats)
        for length in args.prefill_lens
    }
    decode = {}
    for batch, context in parse_shapes(args.decode_shapes):
        decode[f"{batch}@{context}"] = measure_decode(
            engine, SamplingParams, rng, vocab_size, batch, context, args.steps, args.repeats
        )
        print(f"decode {batch}@{context}: {decode[f'{batch}@{context}']}", file=sys.stderr, flush=True)
    scheduler = engine.vllm_config.scheduler_config
    return {
        "prefill": prefill,
        "decode": decode,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "threads": args.threads,
        "torch_num_threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "dtype": args.dtype,
        "kv_cache_gib": int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
        "max_num_batched_tokens": scheduler.max_num_batched_tokens,
        "compilation_mode": str(engine.vllm_config.compilation_config.mode),
        "decode_steps_per_repeat": args.steps,
        **described,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, choices=(1, 2), default=1, help="OpenMP threads, on cores 0..")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per repeat")
    parser.add_argument("--prefill-lens", type=int, nargs="*", default=list(PREFILL_LENS))
    parser.add_argument("--decode-shapes", default=",".join(DECODE_SHAPES), help="batch@context,...")
    args = parser.parse_args()
    if os.environ.get(CHILD_FLAG) != "1":
        gib = kv_cache_gib(Path(args.model), args.dtype, parse_shapes(args.decode_shapes), args.steps,
                           args.repeats)
        env = {**os.environ, **bound_env(args.threads, gib)}
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    result = run(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
