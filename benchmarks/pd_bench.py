"""Decode smoothness under prefill pressure: 1 prefill + 1 decode actor vs one colocated worker (not a test).

Both setups serve the same load, side by side in one run, one torch thread per worker, SmolLM2 by default:
  - `--num-decode` long requests decode steadily (prompt 64 tokens, `--decode-tokens` outputs each);
  - meanwhile a stream of `--prompt-len`-token prompts arrives every `--interval` seconds; they ask for one
    token, so they cost only prefill.
Disaggregated: the prompts go to the prefill actor, the decode actor only decodes.
Colocated: one decode actor prefills the prompts itself, its chunks mixed into the decode steps.
Printed: the long requests' decode tokens/s and inter-token latency p50/p99 in each setup.

    .venv/bin/python benchmarks/pd_bench.py [--model DIR] [--out benchmarks/results/pd.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import ray
import torch

from decode_pool.messages import DecodeRequest
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.requests.orchestrator import run_request
from gateway.requests.router import Router
from llm_engine import EngineConfig, SamplingParams
from llm_engine.default_model import prepare_default_model
from loadgen.summary import percentile
from worker_runtime.roles import Role


async def measure(args: argparse.Namespace, deployment: PDDeployment, colocated: bool) -> dict[str, float]:
    router = Router(deployment)
    decode_actor = deployment.active(Role.DECODE, Role.MIXED)[0].client.handle
    generator = torch.Generator().manual_seed(0)
    long_sampling = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    gaps: list[float] = []
    start = time.perf_counter()
    window = (start + args.warmup, start + args.warmup + args.duration)
    background: set[asyncio.Task[None]] = set()

    def random_prompt(length: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, 49152, (length,), generator=generator).tolist())

    async def token_times(request_id: str, prompt: tuple[int, ...], sampling: SamplingParams
                          ) -> AsyncIterator[float]:
        """Arrival time of each token event, through the colocated worker or through both pools."""
        if colocated:
            async for ref in decode_actor.generate.remote(DecodeRequest(request_id, prompt, sampling)):
                if (await ref).token_ids:
                    yield time.perf_counter()
        else:
            async for event in run_request(router, request_id, prompt, sampling):
                if event.token_ids:
                    yield time.perf_counter()

    async def long_request(index: int) -> None:
        last = None
        async for now in token_times(f"long-{index}", random_prompt(64), long_sampling):
            if last is not None and window[0] <= now <= window[1]:
                gaps.append(now - last)
            last = now

    async def prefill_only(index: int) -> None:
        async for _ in token_times(f"prompt-{index}", random_prompt(args.prompt_len), one_token):
            pass

    longs = [asyncio.ensure_future(long_request(i)) for i in range(args.num_decode)]
    await asyncio.sleep(args.warmup / 2)
    index = 0
    while time.perf_counter() < window[1]:
        task = asyncio.ensure_future(prefill_only(index))
        background.add(task)
        task.add_done_callback(background.discard)
        index += 1
        await asyncio.sleep(args.interval)
    for task in longs + list(background):
        task.cancel()
    await asyncio.gather(*longs, *background, return_exceptions=True)
    return {
        "tokens_per_s": len(gaps) / args.duration,
        "itl_p50_ms": 1000 * percentile(gaps, 50),
        "itl_p99_ms": 1000 * percentile(gaps, 99),
        "itl_mean_ms": 1000 * statistics.fmean(gaps),
        "num_prompts": index,
    }


async def main_async(args: argparse.Namespace) -> None:
    model_dir = args.model or str(prepare_default_model())
    engine = EngineConfig(model_dir, kv_cache_bytes=512 << 20, max_num_batched_tokens=args.budget)
    results = {}
    for name, colocated in (("1 prefill + 1 decode (nixl)", False), ("1 colocated worker", True)):
        layout = {"num_prefill": 0, "num_decode": 0, "num_mixed": 1} if colocated else {}
        deployment = PDDeployment(DeploymentConfig(engine, backend=args.backend, **layout))  # type: ignore[arg-type]
        await deployment.start()
        try:
            results[name] = await measure(args, deployment, colocated)
        finally:
            await deployment.shutdown()
        print(name, results[name], flush=True)
    lines = [
        f"# Prefill pressure on decode ({datetime.now(UTC):%Y-%m-%d}, {platform.node()}, "
        "1 torch thread per worker)",
        "",
        f"Model `{Path(model_dir).name}`; {args.num_decode} decoding requests; a {args.prompt_len}-token "
        f"prompt every {args.interval} s; {args.duration} s measured after {args.warmup} s warm-up; token "
        f"budget {args.budget}/step. The colocated worker uses one core, the PD pair two.",
        "Command: `.venv/bin/python benchmarks/pd_bench.py`",
        "",
        "| setup | decode tok/s | ITL p50 ms | ITL p99 ms | ITL mean ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {r['itl_p50_ms']:.0f} | {r['itl_p99_ms']:.0f} | "
                     f"{r['itl_mean_ms']:.0f} |")
    pd, co = results["1 prefill + 1 decode (nixl)"], results["1 colocated worker"]
    lines += ["", f"ITL p99 colocated / PD: {co['itl_p99_ms'] / pd['itl_p99_ms']:.1f}×; decode tok/s PD / "
              f"colocated: {pd['tokens_per_s'] / co['tokens_per_s']:.2f}×"]
    print("\n".join(lines))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--backend", default="nixl")
    parser.add_argument("--num-decode", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--warmup", type=float, default=6.0)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--out", default="benchmarks/results/pd.md")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main_async(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
