"""One `pdserve bench` run: build the workload, send it open-loop, sample /metrics, write the results.

Output directory: requests.jsonl (one RequestRecord per line), metrics.jsonl (the /metrics samples),
summary.json (see summary.py), and PNG plots (plots.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from loadgen.client import RequestRecord, send_one
from loadgen.plots import plot_run
from loadgen.sampler import Sample, sample_metrics
from loadgen.summary import SLO, summarize
from loadgen.workload import build_requests, read_trace


@dataclass(frozen=True)
class BenchConfig:
    url: str
    out_dir: Path
    model: str | None = None  # None: the first model the server lists
    rate: float | None = None  # requests/s; None replays the trace's timestamps
    burstiness: float = 1.0
    speed: float = 1.0  # trace replay speed-up
    num_requests: int = 100
    duration_s: float | None = None
    input_len: int | None = None
    output_len: int | None = None
    trace: Path | None = None
    length_scale: float = 1.0
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.2
    vocab_size: int = 32000
    seed: int = 0
    prompt_seed: int | None = None  # other prompts with the same lengths and arrivals (see build_requests)
    api_key: str | None = None
    metrics_interval_s: float = 0.5
    show_progress: bool = True


async def _run(config: BenchConfig) -> tuple[list[RequestRecord], list[Sample]]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    trace = read_trace(config.trace) if config.trace else None
    specs = build_requests(
        config.num_requests,
        config.vocab_size,
        config.seed,
        config.rate,
        config.burstiness,
        trace,
        config.speed,
        config.input_len,
        config.output_len,
        config.length_scale,
        config.duration_s,
        config.prompt_seed,
    )
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=None, limits=limits) as client:
        model = config.model
        if model is None:
            listed = await client.get("/v1/models")
            listed.raise_for_status()
            model = listed.json()["data"][0]["id"]
        samples: list[Sample] = []
        stop = asyncio.Event()
        start = time.perf_counter()
        sampler = asyncio.ensure_future(
            sample_metrics(client, start, config.metrics_interval_s, stop, samples)
        )
        progress = tqdm(total=len(specs), unit="req", disable=not config.show_progress)
        tasks = [asyncio.ensure_future(send_one(client, spec, model, start)) for spec in specs]
        records = []
        for done in asyncio.as_completed(tasks):
            records.append(await done)
            progress.update(1)
        progress.close()
        stop.set()
        await sampler
    records.sort(key=lambda r: r.index)
    return records, samples


def run_bench(config: BenchConfig) -> dict[str, object]:
    """Run the load, write every output file, and return the summary."""
    random.seed(config.seed)
    records, samples = asyncio.run(_run(config))
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    (out / "metrics.jsonl").write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in samples))
    summary = summarize(records, SLO(config.ttft_slo_s, config.itl_slo_s))
    summary["config"] = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in dataclasses.asdict(config).items()
        if k != "api_key"
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=True))
    plot_run(records, samples, out)
    return summary
