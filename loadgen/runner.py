"""One `pdserve bench` run: build the workload, send it open-loop, sample /metrics, write the results.

    ask the server for its models (unreachable → ServerUnreachable; no --model → the first it lists)
    → warm-up requests, one at a time, not recorded → every request leaves at its arrival time, at most
      max_concurrency in flight (a semaphore: later ones wait for a slot) → summary → files

Output directory: requests.jsonl (one RequestRecord per line), metrics.jsonl (the /metrics samples),
summary.json (pdserve's figures, summary.py, beside vLLM's key names), and PNG plots (plots.py); with
`save_result`, that summary is also written where vLLM's `--save-result` writes it, and with `save_detailed`
it carries vLLM's per-request lists too (`ttfts`, `itls`, ...: requests.jsonl has the same, as records).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

from loadgen.client import RequestOptions, RequestRecord, send_now
from loadgen.datasets import as_text, sharegpt_requests
from loadgen.plots import plot_run
from loadgen.sampler import Sample, sample_metrics
from loadgen.summary import (
    DEFAULT_ITL_SLO_S,
    DEFAULT_TTFT_SLO_S,
    PERCENTILE_METRICS,
    SLO,
    summarize,
    vllm_figures,
    vllm_request_lists,
)
from loadgen.workload import RequestSpec, build_requests, read_trace

DATASETS = ("random", "sharegpt", "trace")


class ServerUnreachable(RuntimeError):
    """The server did not answer (connection refused, DNS, timeout) or would not list its models."""


@dataclass(frozen=True)
class BenchConfig:
    url: str
    out_dir: Path
    model: str | None = None  # None: the first model the server lists
    dataset: str = "random"  # one of DATASETS
    dataset_path: Path | None = None  # the ShareGPT JSON or the trace (Azure CSV / Mooncake JSONL)
    rate: float | None = None  # requests/s (inf: all at once); None replays the trace's timestamps
    burstiness: float = 1.0
    speed: float = 1.0  # trace replay speed-up
    num_requests: int = 100
    duration_s: float | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float = 0.0  # random lengths spread over [len·(1 - r), len·(1 + r)]
    sharegpt_output_len: int | None = None  # None: each reply's length, counted by `tokenizer`
    tokenizer: str | None = None  # a tokenizer directory (ShareGPT reply lengths)
    length_scale: float = 1.0
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    itl_slo_s: float = DEFAULT_ITL_SLO_S
    goodput: SLO | None = None  # vLLM's --goodput: request_goodput against these limits
    vocab_size: int = 32000
    seed: int = 0
    prompt_seed: int | None = None  # other prompts with the same lengths and arrivals (see build_requests)
    api_key: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)  # endpoint, sampling, extra body
    label: str | None = None  # vLLM's --label: the result file's prefix (None: the backend)
    max_concurrency: int | None = None  # None: no limit on requests in flight
    num_warmups: int = 0
    percentile_metrics: tuple[str, ...] = PERCENTILE_METRICS
    metric_percentiles: tuple[float, ...] = (50.0, 90.0, 99.0)
    save_result: bool = False  # also write the summary as vLLM's --save-result does
    save_detailed: bool = False  # and put vLLM's per-request lists in it (--save-detailed)
    result_dir: Path | None = None  # None: the current directory
    result_filename: str | None = None  # None: vLLM's name (result_path)
    metrics_interval_s: float = 0.5
    show_progress: bool = True


def build_workload(config: BenchConfig) -> list[RequestSpec]:
    """The run's requests. Raises ValueError (naming what is missing) for an incomplete dataset choice."""
    rate = config.rate
    if config.dataset == "sharegpt":
        if config.dataset_path is None:
            raise ValueError("--dataset-path: ShareGPT needs its JSON file")
        specs = sharegpt_requests(config.dataset_path, config.num_requests, config.seed,
                                  math.inf if rate is None else rate, config.burstiness,
                                  config.sharegpt_output_len, config.tokenizer)
    else:
        trace = None
        if config.dataset == "trace":
            if config.dataset_path is None:
                raise ValueError("--dataset-path: the trace dataset needs an Azure CSV or a Mooncake JSONL")
            trace = read_trace(config.dataset_path)
        specs = build_requests(config.num_requests, config.vocab_size, config.seed, rate, config.burstiness,
                               trace, config.speed, config.input_len, config.output_len, config.length_scale,
                               config.duration_s, config.prompt_seed, config.range_ratio)
    return as_text(specs, config.seed) if config.options.endpoint == "/v1/chat/completions" else specs


async def _first_model(client: httpx.AsyncClient, url: str, model: str | None) -> str:
    try:
        listed = await client.get("/v1/models", timeout=30)
    except httpx.HTTPError as error:
        raise ServerUnreachable(f"{url}: {type(error).__name__}: {error or 'no answer'}") from None
    if model is not None:
        return model  # a server without /v1/models can still be benched with a name
    if listed.status_code != 200:
        raise ServerUnreachable(f"{url}/v1/models answered {listed.status_code}: {listed.text[:200]}")
    return str(listed.json()["data"][0]["id"])


async def _run(config: BenchConfig,
               specs: list[RequestSpec]) -> tuple[list[RequestRecord], list[Sample], str]:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    options = config.options
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=None, limits=limits) as client:
        model = await _first_model(client, config.url, config.model)
        for spec in specs[:config.num_warmups]:  # warm caches and compiled paths; not counted
            await send_now(client, spec, model, time.perf_counter(), options)
        samples: list[Sample] = []
        stop = asyncio.Event()
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        start = time.perf_counter()

        async def send(spec: RequestSpec) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
            if slots is None:
                return await send_now(client, spec, model, start, options)
            async with slots:
                return await send_now(client, spec, model, start, options)

        sampler = asyncio.ensure_future(
            sample_metrics(client, start, config.metrics_interval_s, stop, samples)
        )
        progress = tqdm(total=len(specs), unit="req", disable=not config.show_progress)
        tasks = [asyncio.ensure_future(send(spec)) for spec in specs]
        records = []
        for done in asyncio.as_completed(tasks):
            records.append(await done)
            progress.update(1)
        progress.close()
        stop.set()
        await sampler
    records.sort(key=lambda r: r.index)
    return records, samples, model


def result_path(config: BenchConfig, summary: dict[str, object]) -> Path:
    """Where --save-result writes: --result-filename, else the name `vllm bench serve` would give."""
    name = config.result_filename
    if name is None:
        concurrency = f"-concurrency{config.max_concurrency}" if config.max_concurrency is not None else ""
        rate = "inf" if config.rate is None or math.isinf(config.rate) else config.rate
        model = str(summary["model_id"]).split("/")[-1]
        name = f"{config.label or summary['backend']}-{rate}qps{concurrency}-{model}-{summary['date']}.json"
    return (config.result_dir or Path()) / name


def _plain(value: object) -> object:
    """A config value as strict JSON: paths as text, an infinite rate or limit as "inf"."""
    if isinstance(value, Path) or (isinstance(value, float) and not math.isfinite(value)):
        return str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def run_bench(config: BenchConfig) -> dict[str, object]:
    """Run the load, write every output file, and return the summary.

    Raises:
        ValueError: an incomplete workload (naming the flag).
        ServerUnreachable: the server did not answer.
    """
    random.seed(config.seed)
    specs = build_workload(config)
    records, samples, model = asyncio.run(_run(config, specs))
    out = config.out_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "requests.jsonl").write_text("".join(r.to_json() + "\n" for r in records))
    (out / "metrics.jsonl").write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in samples))
    backend = "openai-chat" if config.options.endpoint == "/v1/chat/completions" else "openai"
    summary: dict[str, object] = {
        # vLLM's header keys (`vllm bench serve --save-result`), then its figures, then pdserve's own.
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,  # vLLM writes both names
        "backend": backend,
        "label": config.label,
        "model_id": model,
        "tokenizer_id": config.tokenizer or model,  # vLLM's: --tokenizer, else the model
        "num_prompts": len(specs),
        "request_rate": "inf" if config.rate is not None and math.isinf(config.rate) else config.rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
    }
    summary.update(vllm_figures(records, config.percentile_metrics, config.metric_percentiles,
                                config.goodput))
    lists = vllm_request_lists(records)
    summary.update(lists if config.save_detailed else
                   {key: lists[key] for key in ("latencies", "queue_times")})  # what vLLM always keeps
    summary.update(summarize(records, SLO(config.ttft_slo_s, config.itl_slo_s)))
    summary["error_samples"] = sorted({r.error for r in records if r.error})[:5]
    summary["config"] = {k: _plain(v) for k, v in dataclasses.asdict(config).items() if k != "api_key"}
    text = json.dumps(summary, indent=2, default=str)
    (out / "summary.json").write_text(text)
    if config.save_result:
        result_file = result_path(config, summary)
        result_file.parent.mkdir(parents=True, exist_ok=True)
        result_file.write_text(text)
        summary["result_file"] = str(result_file)
    plot_run(records, samples, out)
    return summary
