"""Soak benchmark (not a test): a real `pdserve serve` under mixed open-loop traffic while workers get killed.

    .venv/bin/python benchmarks/soak.py --duration 900 --out benchmarks/results/soak

A run, in order:
  1. starts its own Ray head (`ray start --head --block`, its own ports and temp dir), then `pdserve serve
     --address` on it: 1 prefill + 2 decode workers serving a tiny random Llama with SmolLM2's tokenizer
     (so the soak measures the serving system, not model compute), or --model DIR, or --model default;
  2. --warmup s of traffic, then the baseline sample (RSS of every process of the system);
  3. --duration s of Poisson arrivals at --rate: short/long prompts and outputs, completions and chat,
     streaming and not, and client cancellations at --cancel-fraction (a stream closed before its first
     token or after a random number of tokens; a whole response given up after a random delay). Meanwhile
     one random worker (--kill-busy: one with requests running) gets SIGKILL every --kill-every s (the
     gateway must replace it; each replacement is timed until /health is "ok" again), and every
     --sample-every s /health, /admin/pools and the RSS of every process are recorded;
  4. waits for in-flight requests (one still open --hang-after s after it left counts as hung and is
     closed), then up to --settle s for every worker's used KV blocks to reach 0 (an unpulled handoff is
     freed when its 30 s lease ends), and takes the end sample;
  5. writes requests.jsonl, samples.jsonl, health.jsonl, summary.json, summary.md, soak.png, server.log (the
     gateway's and its actors' output) and ray_head.log under --out, prints summary.md, and stops only the
     processes it started.
Results are files, never asserts. Only this process's own Ray head is touched (never `ray stop`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.reliability.soaklib.cluster import SoakSystem, prepare_model
from tests.reliability.soaklib.config import SoakConfig
from tests.reliability.soaklib.kills import WorkerKiller
from tests.reliability.soaklib.report import SoakResult, write_report
from tests.reliability.soaklib.sampling import SoakMonitor, server_counters
from tests.reliability.soaklib.traffic import SoakRecord, build_specs, send


async def run_soak(config: SoakConfig, system: SoakSystem, model_dir: Path) -> SoakResult:
    """Steps 2 to 4: warm-up and baseline; traffic, kills and samples; drain, settle and the end sample."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=system.url, timeout=None, limits=limits) as client:
        listed = (await client.get("/v1/models")).json()["data"][0]
        model, max_model_len = listed["id"], int(listed.get("max_model_len") or 2048)
        vocab_size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        specs = build_specs(config, vocab_size, max_model_len)
        monitor = SoakMonitor(config, system, client)
        killer = WorkerKiller(monitor)
        monitor.start = time.perf_counter()
        phase = ["warmup" if config.warmup_s else "soak"]
        sampler = asyncio.create_task(monitor.sample_forever(phase))
        tasks = [asyncio.create_task(send(client, s, model, monitor.start, config.hang_after_s,
                                          monitor.in_flight))
                 for s in specs]
        await asyncio.sleep(max(0.0, config.warmup_s - monitor.now()))
        phase[0] = "soak"
        baseline = await monitor.take_sample("baseline")
        killing = asyncio.create_task(killer.kill_forever(random.Random(config.seed + 1))) if (
            config.kill_every_s > 0) else None
        records: list[SoakRecord] = list(await asyncio.gather(*tasks))
        if killing is not None:
            try:
                await killing  # schedules no kill past the soak; lets the last replacement be timed
            except Exception as error:  # report what the soak saw rather than lose it
                killer.kills.append({"t_s": monitor.now(), "error": f"the killer failed: {error!r}"})
        phase[0] = "drain"
        kv_end = await monitor.settle()
        sampler.cancel()
        end = await monitor.take_sample("end")
        try:
            counters = server_counters((await client.get("/metrics", timeout=30)).text)
        except httpx.HTTPError:  # the gateway itself is gone: the report says so through its other parts
            counters = {}
    return SoakResult(model=model, model_dir=str(model_dir), records=records, samples=monitor.samples,
                      health_log=monitor.health_log, kills=killer.kills, baseline=baseline, end=end,
                      kv_end=kv_end, server_counters=counters, samples_missed=monitor.samples_missed)


def parse_args() -> SoakConfig:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=900.0, help="seconds of soak traffic")
    parser.add_argument("--out", default="benchmarks/results/soak")
    parser.add_argument("--model", default=None,
                        help="model dir, or 'default' (SmolLM2); default: a tiny random Llama")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=2)
    parser.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    parser.add_argument("--cancel-fraction", type=float, default=0.15)
    parser.add_argument("--kill-every", type=float, default=180.0, help="seconds; 0 kills nothing")
    parser.add_argument("--kill-busy", action="store_true",
                        help="kill only workers that have requests running at that moment")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of traffic before the baseline")
    parser.add_argument("--sample-every", type=float, default=5.0)
    parser.add_argument("--hang-after", type=float, default=300.0)
    parser.add_argument("--settle", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `pdserve serve` flag, repeatable (e.g. --serve-arg=--kv-cache-mib=64)")
    a = parser.parse_args()
    return SoakConfig(a.duration, Path(a.out), a.model, a.prefill, a.decode, a.rate, a.cancel_fraction,
                      a.kill_every, a.warmup, a.sample_every, a.hang_after, a.settle, a.seed,
                      tuple(a.serve_arg), kill_busy=a.kill_busy)


def main() -> None:
    config = parse_args()
    config.out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="pdsoak-", dir="/tmp"))
    system = SoakSystem(config, work_dir)
    os.environ["RAY_AUTH_MODE"] = "token"  # this driver joins a token-auth head too
    import ray

    try:
        model_dir = prepare_model(config.model, work_dir)  # step 1
        system.start_ray()
        system.start_server(model_dir)
        ray.init(address=f"127.0.0.1:{system.ray_port}", log_to_driver=False, configure_logging=False)
        result = asyncio.run(run_soak(config, system, model_dir))  # steps 2 to 4
    except BaseException:
        print(f"the soak failed; Ray's logs are kept in {work_dir / 'ray'}", file=sys.stderr, flush=True)
        raise
    finally:
        if ray.is_initialized():
            ray.shutdown()
        system.stop()
    summary, text = write_report(config, result)  # step 5
    print(text, flush=True)
    req = summary["requests"]
    if req["errors"] or req["hung"] or not summary["kv_end"]["is_whole"]:
        print(f"Ray's logs of this run are kept in {work_dir / 'ray'}", flush=True)
    else:
        shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
