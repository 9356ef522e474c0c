"""What an 8-bit KV cache buys a prefill → decode handoff, side by side in one run: the same prompts through
`pdserve serve --prefill 1 --decode 1 --dtype bfloat16`, the two workers' KV caches in bfloat16 (`auto`) or
fp8 (e4m3): both bfloat16, both fp8, each way between them (`--prefill-kv-cache-dtype` /
`--decode-kv-cache-dtype`: the handoff converts on arrival), and both bfloat16 with fp8 on the wire
(`--kv-transfer-dtype fp8`: the sender converts, the receiver converts back), the same --kv-cache-memory each.

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

# (prefill worker's cache, decode worker's cache, the wire's), --*-kv-cache-dtype / --kv-transfer-dtype names.
PAIRS = (("auto", "auto", "auto"), ("fp8", "fp8", "auto"), ("auto", "fp8", "auto"), ("fp8", "auto", "auto"),
         ("auto", "auto", "fp8"), ("int8_per_token_head", "int8_per_token_head", "auto"))


@dataclass
class Run:
    kv_dtypes: str  # the prefill, then the decode worker's cache elements, as /admin/pools says
    kv_tokens: int  # the decode worker's capacity
    num_bytes: list[int]  # per request: timings.transfer_bytes
    ms: list[float]  # per request: timings.transfer_ms


def measure(model_dir: Path, pair: tuple[str, str, str], prompts: list[list[int]], kv_memory: str) -> Run:
    port = free_port()
    with pdserve(str(model_dir), port, dtype="bfloat16",
                 extra=("--prefill-kv-cache-dtype", pair[0], "--decode-kv-cache-dtype", pair[1],
                        "--kv-transfer-dtype", pair[2], "--kv-cache-memory", kv_memory)) as url:
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        runtimes = {w["role"]: w["runtime"] for w in pools["workers"] if w.get("runtime")}
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        run = Run(f"{runtimes['prefill']['kv_dtype']} → {runtimes['decode']['kv_dtype']}",
                  runtimes["decode"]["num_kv_tokens"], [], [])
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
    parser.add_argument("--pairs", default="",
                        help="prefill/decode/wire triples to run, comma-separated (default: all; the first, "
                             "auto/auto/auto, is always run: the ratios' base)")
    args = parser.parse_args()
    chosen = [tuple(p.split("/")) for p in args.pairs.split(",") if p]
    pairs = [PAIRS[0], *(p for p in PAIRS[1:] if not chosen or p in chosen)]
    model_dir = prepare_default_model()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt_len,), generator=generator).tolist()
               for _ in range(args.prompts)]
    results = {pair: measure(model_dir, pair, prompts, args.kv_cache_memory) for pair in pairs}
    base = results[PAIRS[0]]
    lines = [f"# KV cache dtype and the handoff (SmolLM2-135M, bfloat16, 1 prefill + 1 decode over NIXL, "
             f"{args.prompts} prompts of {args.prompt_len} tokens, --kv-cache-memory {args.kv_cache_memory})",
             "", "| prefill / decode cache / wire | cache elements | decode KV tokens "
             "| bytes per handoff | handoff ms, median [range] |", "|---|---|---:|---:|---:|"]
    for pair, run in results.items():
        num_bytes, ms = statistics.median(run.num_bytes), statistics.median(run.ms)
        ratios = ("", "", "") if pair == PAIRS[0] else (
            f" ({run.kv_tokens / base.kv_tokens:.2f}×)",
            f" ({num_bytes / statistics.median(base.num_bytes):.2f}×)",
            f" ({ms / statistics.median(base.ms):.2f}×)")
        spread = f"[{min(run.ms):.1f}–{max(run.ms):.1f}]"
        lines.append(f"| {' / '.join(pair)} | {run.kv_dtypes} | {run.kv_tokens:,}{ratios[0]} | "
                     f"{num_bytes:,.0f}{ratios[1]} | {ms:.1f} {spread}{ratios[2]} |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
