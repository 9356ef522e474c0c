"""`pdserve bench`: open-loop load against any OpenAI-compatible server (the loadgen package), with the
flags and result keys of vLLM's `vllm bench serve`, and pdserve's extras (stage timings, /metrics samples,
plots). Its flags are made from BenchSettings (pdserve/settings_cli.py): each is also an environment
variable PDSERVE_BENCH_<FIELD>. Precedence: flags > environment > defaults.

Exit status: 0 when every request succeeded, 1 when any failed (the count is printed), 2 for a bad flag or
a server that does not answer.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from loadgen.summary import DEFAULT_ITL_SLO_S, DEFAULT_TTFT_SLO_S, PERCENTILE_METRICS
from pdserve.settings_cli import add_model_flags, error_message, given_flags, layer_sources

ENV_PREFIX = "PDSERVE_BENCH_"


class BenchSettings(BaseSettings):
    """`pdserve bench`'s settings: vLLM's flag names first, pdserve's older names as hidden aliases."""

    model_config = SettingsConfigDict(extra="forbid", env_prefix=ENV_PREFIX, case_sensitive=False)

    base_url: str = Field("http://127.0.0.1:8000", description="the server's base URL")
    model: str | None = Field(None, description="model name to send (default: the first the server lists)")
    endpoint: Literal["/v1/completions", "/v1/chat/completions"] = Field(
        "/v1/completions",
        description="API to call; chat sends one user message of text")
    dataset_name: Literal["random", "sharegpt", "trace"] | None = Field(
        None,
        description="random token ids; sharegpt (a ShareGPT JSON: first human turn as the prompt); trace (an "
                    "Azure CSV or Mooncake JSONL replay) (default: from --dataset-path: .json sharegpt, "
                    ".csv/.jsonl trace; none: random)")
    dataset_path: str | None = Field(None, description="the ShareGPT JSON or the trace file (default: none)")
    num_prompts: int = Field(100, gt=0, description="requests to send")
    request_rate: float | None = Field(
        None, gt=0,
        description="requests/s, Poisson (or gamma, --burstiness); inf sends all at once (default: inf; with "
                    "a trace: its own timestamps, sped up by --speed)")
    burstiness: float = Field(
        1.0, gt=0,
        description="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier")
    max_concurrency: int | None = Field(
        None, gt=0,
        description="requests in flight at most; later arrivals wait for a slot (default: no limit)")
    duration_s: float | None = Field(
        None, gt=0,
        description="send no request that would arrive after this many seconds (default: no limit)")
    random_input_len: int = Field(1024, gt=0, description="prompt tokens (dataset random)")
    random_output_len: int = Field(128, gt=0, description="max_tokens (dataset random)")
    random_range_ratio: float = Field(
        0.0, ge=0, lt=1,
        description="random lengths spread uniformly over [len·(1 - r), len·(1 + r)]")
    sharegpt_output_len: int | None = Field(
        None, gt=0,
        description="max_tokens of every ShareGPT request (default: the reply's length in tokens, counted by "
                    "--tokenizer)")
    tokenizer: str | None = Field(
        None,
        description="tokenizer directory, to count ShareGPT replies (default: none)")
    speed: float = Field(1.0, gt=0, description="trace replay speed-up")
    length_scale: float = Field(1.0, gt=0, description="multiply trace lengths by this")
    vocab_size: int = Field(32000, gt=0, description="random prompt token ids stay below this")
    ignore_eos: bool | None = Field(
        None,
        description="send ignore_eos: true, so every request runs to its max_tokens (default: on for the "
                    "random and trace datasets, as vLLM's, off (not sent) for sharegpt)")
    # Sampling, as vLLM's `vllm bench serve` sends it (since vLLM PR #32723, in vLLM 0.32): a field not given
    # is not sent, so the server's default applies (its --generation-config); --temperature 0 is greedy.
    temperature: float | None = Field(
        None, ge=0,
        description="sampling temperature; 0 decodes greedily (default: not sent, the server's, as vLLM's)")
    top_p: float | None = Field(None, gt=0, le=1, description="top_p (default: not sent)")
    top_k: int | None = Field(None, description="top_k (default: not sent)")
    min_p: float | None = Field(None, ge=0, le=1, description="min_p (default: not sent)")
    frequency_penalty: float | None = Field(None, description="frequency_penalty (default: not sent)")
    presence_penalty: float | None = Field(None, description="presence_penalty (default: not sent)")
    repetition_penalty: float | None = Field(None, gt=0, description="repetition_penalty (default: not sent)")
    extra_body: dict[str, Any] | None = Field(
        None,
        description="a JSON object merged into every request body, last, so it overrides the fields above, "
                    """e.g. '{"chat_template_kwargs": {"enable_thinking": false}}' (default: none)""")
    num_warmups: int = Field(0, ge=0, description="requests sent one at a time before the run, not counted")
    percentile_metrics: str = Field(
        ",".join(PERCENTILE_METRICS),
        description="metrics to report percentiles of, comma-separated")
    metric_percentiles: str = Field("50,90,99", description="percentiles to report, comma-separated")
    goodput: list[str] | None = Field(
        None,
        description="request_goodput's SLOs as KEY:MS pairs, e.g. ttft:500 tpot:50 e2el:2000 (default: none, "
                    "no request_goodput)")
    ttft_slo_s: float = Field(DEFAULT_TTFT_SLO_S, gt=0, description="pdserve's goodput: TTFT target, s")
    itl_slo_s: float = Field(DEFAULT_ITL_SLO_S, gt=0, description="pdserve's goodput: TPOT target, s")
    save_result: bool = Field(False, description="also write the result JSON as vLLM does")
    save_detailed: bool = Field(
        False,
        description="put vLLM's per-request lists in the result JSON too (input_lens, output_lens, ttfts, "
                    "itls, start_times, errors)")
    label: str | None = Field(None, description="the result file name's prefix (default: the backend)")
    result_dir: str | None = Field(
        None,
        description="where --save-result writes (default: the current directory)")
    result_filename: str | None = Field(
        None,
        description="its file name (default: vLLM's, {label}-{rate}qps-concurrency{n}-{model}-{date}.json)")
    out: str = Field(
        "bench-out",
        description="pdserve's results directory: requests, /metrics samples, summary, plots")
    seed: int = Field(0, description="seed of the arrivals and prompts")
    api_key: str | None = Field(None, description="Bearer key (default: PDSERVE_API_KEY)")
    disable_tqdm: bool = Field(False, description="no progress bar")


ALIASES = {"base_url": ["--url"]}


def add_bench_parser(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="open-loop load against an OpenAI-compatible server (vllm bench serve's flags)",
        epilog=f"Every flag is also an environment variable {ENV_PREFIX}<FLAG NAME> (e.g. "
               f"{ENV_PREFIX}REQUEST_RATE). Precedence: flags > environment > defaults. Exit status 1 when "
               "any request failed, 2 for a bad flag or a server that does not answer.")
    add_model_flags(bench, BenchSettings, aliases=ALIASES)
    bench.set_defaults(handler=run_bench_command)


def _dataset(settings: BenchSettings) -> str:
    if settings.dataset_name is not None:
        return settings.dataset_name
    suffix = Path(settings.dataset_path or "").suffix
    return {".json": "sharegpt", ".csv": "trace", ".jsonl": "trace"}.get(suffix, "random")


def _numbers(flag: str, text: str) -> tuple[float, ...]:
    try:
        return tuple(float(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected numbers separated by commas, got {text!r}") from None


def bench_config(settings: BenchSettings) -> Any:
    """The loadgen BenchConfig of these settings. Raises ValueError naming the flag."""
    from loadgen.client import RequestOptions
    from loadgen.runner import BenchConfig
    from loadgen.summary import parse_goodput

    metrics = tuple(m.strip() for m in settings.percentile_metrics.split(",") if m.strip())
    unknown = [m for m in metrics if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: {', '.join(unknown)} unknown; known: "
                         f"{', '.join(PERCENTILE_METRICS)}")
    quantiles = _numbers("--metric-percentiles", settings.metric_percentiles)
    if not all(0 <= q <= 100 for q in quantiles):
        raise ValueError(f"--metric-percentiles: each must be in [0, 100], got {settings.metric_percentiles}")
    try:
        goodput = parse_goodput(settings.goodput) if settings.goodput else None
    except ValueError as error:
        raise ValueError(f"--goodput: {error}") from None
    dataset = _dataset(settings)
    rate = settings.request_rate
    if rate is None and dataset != "trace":
        rate = float("inf")
    ignore_eos = settings.ignore_eos if settings.ignore_eos is not None else dataset in ("random", "trace")
    options = RequestOptions(
        endpoint=settings.endpoint, ignore_eos=True if ignore_eos else None, temperature=settings.temperature,
        top_p=settings.top_p, top_k=settings.top_k, min_p=settings.min_p,
        frequency_penalty=settings.frequency_penalty, presence_penalty=settings.presence_penalty,
        repetition_penalty=settings.repetition_penalty, extra_body=settings.extra_body or {})
    return BenchConfig(
        url=settings.base_url.rstrip("/"), out_dir=Path(settings.out), model=settings.model, dataset=dataset,
        dataset_path=Path(settings.dataset_path) if settings.dataset_path else None, rate=rate,
        burstiness=settings.burstiness, speed=settings.speed, num_requests=settings.num_prompts,
        duration_s=settings.duration_s,
        input_len=settings.random_input_len if dataset == "random" else None,
        output_len=settings.random_output_len if dataset == "random" else None,
        range_ratio=settings.random_range_ratio, sharegpt_output_len=settings.sharegpt_output_len,
        tokenizer=settings.tokenizer, length_scale=settings.length_scale, ttft_slo_s=settings.ttft_slo_s,
        itl_slo_s=settings.itl_slo_s, goodput=goodput, vocab_size=settings.vocab_size, seed=settings.seed,
        api_key=settings.api_key or os.environ.get("PDSERVE_API_KEY"), options=options, label=settings.label,
        max_concurrency=settings.max_concurrency, num_warmups=settings.num_warmups,
        percentile_metrics=metrics, metric_percentiles=quantiles, save_result=settings.save_result,
        result_dir=Path(settings.result_dir) if settings.result_dir else None,
        result_filename=settings.result_filename, save_detailed=settings.save_detailed,
        show_progress=not settings.disable_tqdm,
    )


def _ms(value: object) -> str:
    return f"{value:.0f} ms" if isinstance(value, float) else "n/a"


def run_bench_command(args: argparse.Namespace) -> int:
    from loadgen.runner import ServerUnreachable, run_bench

    flags = given_flags(args, BenchSettings)
    try:
        settings = BenchSettings(**flags)
    except ValidationError as error:
        env = {k for k in BenchSettings.model_fields if f"{ENV_PREFIX}{k}".upper() in os.environ}
        message = error_message(error, layer_sources(BenchSettings, flags, dict.fromkeys(env), None))
        print(f"pdserve bench: error: {message}", file=sys.stderr)
        return 2
    config = bench_config(settings)  # its ValueError: main prints it, exit status 2
    if "temperature" not in config.options.sampling() | config.options.extra_body:
        print("pdserve bench: no --temperature: the server's default sampling applies, as with vLLM's "
              "`vllm bench serve`; --temperature 0 decodes greedily", file=sys.stderr)
    try:
        summary = run_bench(config)
    except ServerUnreachable as error:
        print(f"pdserve bench: error: --base-url: the server does not answer: {error}", file=sys.stderr)
        return 2
    saved = f" and {summary['result_file']}" if "result_file" in summary else ""
    print(f"{summary['completed']}/{summary['num_prompts']} ok in {summary['duration']:.1f} s; "
          f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.1f} output tok/s; "
          f"TTFT median {_ms(summary.get('median_ttft_ms'))}, "
          f"TPOT median {_ms(summary.get('median_tpot_ms'))}; results in {settings.out}{saved}")
    failed = summary["failed"]
    if failed:
        samples = summary["error_samples"]
        print(f"pdserve bench: {failed} of {summary['num_prompts']} requests failed; first error: "
              f"{samples[0] if isinstance(samples, list) and samples else '?'}", file=sys.stderr)
        return 1
    return 0
