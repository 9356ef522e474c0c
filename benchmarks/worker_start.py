"""What a worker actor's start costs: CPU-seconds of its process from its start to serving, how long a
1 prefill + 1 decode fleet takes to come up, and its first request's time to first token (what a worker
does lazily on its first step shows there), on one local Ray; optionally side by side with another tree.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/worker_start.py [--model DIR] [--starts 4]
        [--against /path/to/other/tree]   # e.g. a `git worktree add --detach ../base HEAD~1`
With --against, the runs alternate (this tree, the other, the other, this tree) in fresh processes, each
with the other tree first on its PYTHONPATH, and one table prints both sides. The default model is a tiny
random Llama (its start is the process's imports and the engine's set-up, not the weights).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def one_side(model_dir: str, starts: int) -> dict[str, list[float]]:
    """In this process: `starts` fleets started and stopped; each worker's CPU-seconds once serving."""
    import psutil
    import ray

    from gateway.fleet.config import DeploymentConfig
    from gateway.fleet.deployment import PDDeployment
    from gateway.requests.orchestrator import run_request
    from gateway.requests.router import Router
    from llm_engine.config import EngineConfig
    from llm_engine.params import SamplingParams

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    engine = EngineConfig(model_dir, dtype="float32", kv_cache_bytes=16 << 20)
    cpu, wall, first_token = [], [], []

    async def start_once() -> None:
        deployment = PDDeployment(DeploymentConfig(engine, backend="nixl", num_prefill=1, num_decode=1))
        began = time.monotonic()
        await deployment.start()
        wall.append(time.monotonic() - began)
        for process in psutil.process_iter(["cmdline"]):
            if "WorkerActor" in " ".join(process.info["cmdline"] or [])[:200]:
                times = process.cpu_times()
                cpu.append(times.user + times.system)
        sent = time.monotonic()
        async for event in run_request(Router(deployment), "first", (1, 2, 3, 4, 5),
                                       SamplingParams(max_tokens=2, temperature=0.0)):
            if event.token_ids and len(first_token) < len(wall):
                first_token.append((time.monotonic() - sent) * 1e3)
        await deployment.shutdown()

    for _ in range(starts):
        asyncio.run(start_once())
        time.sleep(2)  # the stopped workers' processes go before the next start counts processes
    ray.shutdown()
    return {"worker_cpu_s": cpu, "fleet_up_s": wall, "first_token_ms": first_token}


def run_side(tree: Path, model_dir: str, starts: int) -> dict[str, list[float]]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = (f"import json, sys; sys.path.insert(0, {str(HERE / 'benchmarks')!r}); import worker_start; "
            f"print('RESULT', json.dumps(worker_start.one_side({model_dir!r}, {starts})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True,
                         timeout=1800, check=True)
    ray_cli = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_cli, "stop", "--force"], capture_output=True, check=False)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT "):]))


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}–{max(values):.2f}] (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: a tiny random Llama)")
    parser.add_argument("--starts", type=int, default=4, help="fleet starts per run (default 4)")
    parser.add_argument("--against", type=Path, default=None, help="another tree to run side by side")
    args = parser.parse_args()
    model_dir = args.model
    if model_dir is None:
        from llm_engine.tiny_model import build_tiny_llama

        model_dir = str(build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny"))
    sides = [("this tree", HERE)]
    if args.against is not None:
        other = ("other tree", args.against.resolve())
        sides = [sides[0], other, other, sides[0]]
    print("| run | tree | worker CPU-s to serving, median [min–max] | fleet up, s "
          "| first request's TTFT, ms |")
    print("|---:|---|---:|---:|---:|")
    for i, (name, tree) in enumerate(sides, 1):
        result = run_side(tree, model_dir, args.starts)
        cpu, up = summary(result["worker_cpu_s"]), summary(result["fleet_up_s"])
        first = summary(result["first_token_ms"]) if result.get("first_token_ms") else "(not measured)"
        print(f"| {i} | {name} ({tree}) | {cpu} | {up} | {first} |", flush=True)


if __name__ == "__main__":
    main()
