"""What an 8-bit KV cache buys a prefill → decode handoff, side by side in one run: the same prompts through
`pdserve serve --prefill 1 --decode 1 --dtype bfloat16`, its KV cache in bfloat16 (`--kv-cache-dtype auto`)
and in fp8 (e4m3), the same --kv-cache-memory each.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/kv_dtype_handoff.py [--prompts 12] [--prompt-len 1500]
        [--out benchmarks/results/kv_dtype_handoff.md]
Per server: each worker's KV capacity (/admin/pools `runtime.num_kv_tokens`), and per request the handoff's
`timings.transfer_bytes` and `transfer_ms` (decode's pull of the prompt's blocks over NIXL), medians and
ranges over the prompts, sent one at a time (max_tokens 4).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from benchmarks.lm_eval_parity import free_port, pdserve
from benchmarks.quant_step import RESULTS, write_report
from llm_engine.default_model import prepare_default_model


@dataclass
class Run:
    kv_dtype: str  # the workers' cache elements, as /admin/pools says
    kv_tokens: int  # the smallest worker's capacity
    num_bytes: list[int]  # per request: timings.transfer_bytes
    ms: list[float]  # per request: timings.transfer_ms


def measure(model_dir: Path, kv_dtype: str, prompts: list[list[int]], kv_memory: str) -> Run:
    port = free_port()
    with pdserve(str(model_dir), port, dtype="bfloat16",
                 extra=("--kv-cache-dtype", kv_dtype, "--kv-cache-memory", kv_memory)) as url:
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        runtimes = [w["runtime"] for w in pools["workers"] if w.get("runtime")]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run = Run(runtimes[0]["kv_dtype"], min(r["num_kv_tokens"] for r in runtimes), [], [])
        with httpx.Client(timeout=300) as client:
            for prompt in prompts:
                body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
                timings = client.post(f"{url}/v1/completions", json=body).raise_for_status().json()["timings"]
                run.num_bytes.append(int(timings["transfer_bytes"]))
                run.ms.append(float(timings["transfer_ms"]))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_dtype_handoff.md")
    args = parser.parse_args()
    model_dir = prepare_default_model()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.prompts)]
    results = {name: measure(model_dir, name, prompts, args.kv_cache_memory) for name in ("auto", "fp8")}
    base = statistics.median(results["auto"].num_bytes)
    lines = [f"# KV cache dtype and the handoff (SmolLM2-135M, bfloat16, 1 prefill + 1 decode over NIXL, "
             f"{args.prompts} prompts of {args.prompt_len} tokens, --kv-cache-memory {args.kv_cache_memory})",
             "", "| --kv-cache-dtype | cache elements | KV tokens per worker | bytes per handoff "
             "| handoff ms, median [range] |", "|---|---|---:|---:|---:|"]
    for name, run in results.items():
        num_bytes = statistics.median(run.num_bytes)
        ratio = "" if name == "auto" else f" ({num_bytes / base:.2f}×)"
        lines.append(f"| {name} | {run.kv_dtype} | {run.kv_tokens} | {num_bytes:,.0f}{ratio} | "
                     f"{statistics.median(run.ms):.1f} [{min(run.ms):.1f}–{max(run.ms):.1f}] |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
