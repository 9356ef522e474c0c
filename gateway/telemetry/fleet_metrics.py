"""The fleet's series, drawn at scrape time from its status: workers per role, each live worker's load
(vLLM's num_requests_running / num_requests_waiting / kv_cache_usage_perc / iteration_tokens_total, per
worker) and runtime, prompt tokens queued per pool, and the ratio controller's moves. Names:
gateway/telemetry/metric_names.py.

num_requests_waiting has one more row, `{worker="gateway", role="gateway"}`: the requests waiting in the
gateway's admission line for decode KV (every frontend's). vLLM has no such line (its scheduler's queue is
the engine's), so without it an autoscaling rule on `sum(num_requests_waiting)` would miss the requests
queued in front of the workers.

Nothing is kept between scrapes: a worker that left or changed role takes its old series with it (review
L6), and every frontend of a fleet renders the same series from the same status.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.telemetry.metric_names import MODEL_LABEL, PREFIX
from worker_runtime.info import WorkerRuntime
from worker_runtime.load import StepTokens, WorkerLoad

GATEWAY = "gateway"  # the worker and role labels of the admission line's num_requests_waiting row


@dataclass(frozen=True)
class FleetStatus:
    loads: list[WorkerLoad] = field(default_factory=list)  # the live workers' (the pool watch's latest)
    runtimes: dict[str, WorkerRuntime] = field(default_factory=dict)  # worker id → how it computes
    active: dict[str, int] = field(default_factory=dict)  # role → active workers
    # (from role, to role, reason) → workers the ratio controller moved
    ratio_changes: dict[tuple[str, str, str], int] = field(default_factory=dict)
    scale_changes: dict[str, int] = field(default_factory=dict)  # reason → changes the scale controller made


class FleetCollector(Collector):
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name  # every series' model_name label
        self.status = FleetStatus()  # set before each scrape
        self.num_gateway_waiting = 0  # requests in the admission line (every frontend's), likewise

    def _gauge(self, name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
        return GaugeMetricFamily(PREFIX + name, doc, labels=[MODEL_LABEL, *labels])

    def collect(self) -> Iterator[Metric]:
        status, model = self.status, self.model_name
        workers = self._gauge("pool_workers", "Active workers by role", ["role"])
        for role, count in status.active.items():
            workers.add_metric([model, role], count)
        queued = self._gauge("queued_prompt_tokens", "Prompt tokens waiting per pool", ["pool"])
        for pool in ("prefill", "decode", "mixed"):
            queued.add_metric([model, pool],
                              sum(x.num_queued_prompt_tokens for x in status.loads if x.role == pool))
        running = self._gauge("num_requests_running", "Number of requests in model execution batches, per "
                              "worker", ["worker", "role"])
        waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed, per "
                              "worker", ["worker", "role"])
        usage = self._gauge("kv_cache_usage_perc", "KV-cache usage per worker. 1 means 100 percent usage.",
                            ["worker", "role"])
        step_tokens = HistogramMetricFamily(PREFIX + "iteration_tokens_total",
                                            "Histogram of number of tokens per engine_step.",
                                            labels=[MODEL_LABEL, "worker", "role"])
        for load in status.loads:
            labels = [model, load.worker_id, load.role]
            if load.step_tokens.bounds:  # none from a worker not reporting them
                step_tokens.add_metric(labels, _buckets(load.step_tokens), load.step_tokens.num_tokens)
            running.add_metric(labels, load.num_running)
            waiting.add_metric(labels, load.num_waiting)
            usage.add_metric(labels, load.kv_occupancy)
        waiting.add_metric([model, GATEWAY, GATEWAY], self.num_gateway_waiting)
        # How each worker computes (1 per live worker; the labels carry the facts, Prometheus' info idiom).
        runtime = self._gauge("worker_runtime_info",
                              "A worker's dtype, weights, KV cache dtype, GEMM kernel, decode attention, "
                              "compiled or eager body, torch threads",
                              ["worker", "dtype", "weights", "kv_dtype", "linear_kernel", "decode_attention",
                               "compile", "threads"])
        speedup = self._gauge("linear_kernel_speedup",
                              "Load-time probe: F.linear time over the chosen GEMM kernels'", ["worker"])
        for worker_id, facts in status.runtimes.items():
            runtime.add_metric([model, worker_id, facts.dtype, facts.weights, facts.kv_dtype,
                                facts.linear_kernel, facts.decode_attention, facts.compile,
                                str(facts.num_threads)], 1)
            if facts.linear_kernel_speedup is not None:
                speedup.add_metric([model, worker_id], facts.linear_kernel_speedup)
        changes = CounterMetricFamily(PREFIX + "ratio_changes",
                                      "Workers moved between roles by the ratio controller",
                                      labels=[MODEL_LABEL, "from", "to", "reason"])
        for (from_role, to_role, reason), count in status.ratio_changes.items():
            changes.add_metric([model, from_role, to_role, reason], count)
        scaled = CounterMetricFamily(PREFIX + "scale_changes",
                                     "Changes of the fleet's size (or split) made by the scale controller",
                                     labels=[MODEL_LABEL, "reason"])
        for reason, count in status.scale_changes.items():
            scaled.add_metric([model, reason], count)
        yield from (workers, queued, running, waiting, usage, step_tokens, runtime, speedup, changes, scaled)


def _buckets(tokens: StepTokens) -> list[tuple[str, float]]:
    """The histogram's cumulative (le, count) pairs, +Inf last."""
    bounds = [*(str(float(b)) for b in tokens.bounds), "+Inf"]
    cumulative, total = [], 0
    for bound, count in zip(bounds, tokens.bucket_counts, strict=True):
        total += count
        cumulative.append((bound, float(total)))
    return cumulative
