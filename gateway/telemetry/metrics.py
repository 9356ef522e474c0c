"""Prometheus metrics of one gateway (its own registry: no module-level globals, one set per app).

Names, kinds and labels are listed in gateway/telemetry/metric_names.py (vLLM's names under `pdserve:`, a
`model_name` label on every series); bucket boundaries are vLLM's where a series has a vLLM twin, so that
its dashboards' quantiles read the same.

Three kinds of series. The request path's (counters and histograms of finished requests, HTTP statuses, the
admission line) are this process's; with several frontends (--api-server-count) each writes them to
prometheus_client's multiprocess files (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before any frontend
starts) and any frontend's /metrics sums them all. The HTTP series in vLLM's shape (`http_requests_total`,
`http_request_duration_seconds`, ...) are prometheus-fastapi-instrumentator's (gateway/api/http_metrics.py),
in their own registry (`http_registry`), summed the same way. The fleet's (workers per role, each worker's
load and runtime, ratio changes) are drawn at scrape time from the fleet's own status
(gateway/telemetry/fleet_metrics.py), so they are the same whichever frontend answers and a departed worker's
series leave with it; the admission line's length joins them as the `gateway` row of num_requests_waiting.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gateway.telemetry.fleet_metrics import FleetCollector, FleetStatus
from gateway.telemetry.metric_names import MODEL_LABEL, PREFIX
from gateway.telemetry.timings import Timings

# vLLM's boundaries: time to first token; inter-token and per-request time per output token; a whole request
# and its queue, prefill and decode phases.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
# vLLM's for a request's `n` (request_params_n).
REQUEST_N_BUCKETS = (1, 2, 5, 10, 20)
# Ours, for the stages and hops, from 1 ms (a hop between processes, a KV pull on one host) to 2 min (a long
# CPU prefill): vLLM's request buckets start at 0.3 s, too coarse for a transfer.
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10,
                 20, 40, 80, 120)
# A request's stages, and the hops between processes the stages leave out (see
# gateway/requests/stage_timings.py).
STAGES = ("gateway_queue", "prefill_queue", "prefill", "transfer", "decode_queue", "decode",
          "to_prefill", "handoff", "delivery")
DEFAULT_MAX_MODEL_LEN = 131072


def token_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def is_multiprocess() -> bool:
    """Whether this process is one of several frontends sharing the metrics files."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class _Families(Collector):
    """Metric families already collected, in the shape generate_latest() reads (a registry's collect())."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return self._families


class Metrics:
    def __init__(self, model_name: str = "", max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 http_registry: CollectorRegistry | None = None) -> None:
        """Args:
        model_name: the served model name, the `model_name` label of every series.
        max_model_len: the largest prompt or output length (the token histograms' last bucket).
        http_registry: the HTTP series in vLLM's shape (gateway/api/http_metrics.py), rendered with these.
        """
        self.model_name = model_name
        # No `_created` twin of every counter and histogram (as vLLM): half the series, nothing charted reads
        # them. prometheus_client's switch is process-wide; this process has only these metrics.
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self._fleet = FleetCollector(model_name)
        # This process's series; with several frontends, every frontend's, summed from the files (the HTTP
        # registry's included: prometheus_client writes every metric of the process there).
        self._sources: list[CollectorRegistry] = [self.registry]
        if http_registry is not None:
            self._sources.append(http_registry)
        if is_multiprocess():
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            self._sources = [merged]
        model = (model_name,)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            family = Histogram(PREFIX + name, doc, [MODEL_LABEL], buckets=buckets, registry=self.registry)
            return family.labels(*model)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, [MODEL_LABEL, *labels], registry=self.registry)

        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             TOKEN_GAP_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", TOKEN_GAP_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time before the prompt started computing (gateway + prefill queue).",
                                    REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Time spent computing the prompt.",
                                      REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds",
                                     "Time on the decode worker's running batch.", REQUEST_BUCKETS)
        lengths = token_buckets(max_model_len)
        self.prompt_lengths = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                        lengths)
        self.output_lengths = histogram("request_generation_tokens", "Number of generation tokens processed.",
                                        lengths)
        # vLLM's: its longest choice (n > 1), the request's n and max_tokens, its time computing.
        self.max_output_lengths = histogram("request_max_num_generation_tokens",
                                            "Tokens generated by the request's longest choice.",
                                            lengths)
        self.params_n = histogram("request_params_n", "Histogram of the n request parameter.",
                                  REQUEST_N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.", lengths)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Time computing: the prompt's prefill and the decode.",
                                        REQUEST_BUCKETS)
        stage = Histogram(PREFIX + "request_stage_seconds", "Time a request spent in each stage and hop",
                          [MODEL_LABEL, "stage"], buckets=STAGE_BUCKETS, registry=self.registry)
        # Bound once: labels() takes a lock and builds a key, nine times per request otherwise.
        self._stage_children = {name: stage.labels(model_name, name) for name in STAGES}
        self._success = counter("request_success", "Count of finished requests by finish reason.",
                                ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.").labels(*model)
        self.output_tokens = counter("generation_tokens",
                                     "Number of generation tokens processed.").labels(*model)
        self.preemptions = counter("num_preemptions",
                                   "Cumulative number of preemptions (on the worker that finished each "
                                   "request).").labels(*model)
        # Per prefilling worker: a prefill worker, or a decode or mixed worker that prefilled for itself.
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prefix cache queries, in prompt tokens.",
                                            ("worker",))
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prefix cache hits, in prompt tokens.",
                                         ("worker",))
        self.transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved prefill→decode").labels(*model)
        self._request_errors = counter("request_errors", "Requests ended with an error, by cause", ("code",))
        self.migrations = counter("migrations",
                                  "Streams moved to another decode worker after a failure").labels(*model)
        self.stalled_streams = counter("stalled_streams", "Streams cut because the client stopped reading "
                                       "past the deadline").labels(*model)
        self._http = counter("http_requests", "HTTP responses by route template, method and status",
                             ("handler", "method", "status"))
        self.admission_waiting = Gauge(
            PREFIX + "admission_waiting_requests", "Requests waiting at the gateway for decode KV capacity",
            [MODEL_LABEL], registry=self.registry, multiprocess_mode="livesum").labels(*model)
        self.admission_reserved = Gauge(
            PREFIX + "admission_reserved_tokens", "Decode KV tokens reserved", [MODEL_LABEL],
            registry=self.registry, multiprocess_mode="livesum").labels(*model)

    def observe_request(self, timings: Timings, outcome: str, num_prompt: int, num_output: int,
                        num_preemptions: int = 0, n: int = 1, max_tokens: int = 0,
                        num_longest_output: int | None = None) -> None:
        """A finished request. `num_output` counts every choice's tokens, `num_longest_output` its longest
        choice's (default: num_output); the timings follow its longest. `n` and `max_tokens` as asked (the
        defaults filled in)."""
        self._success.labels(self.model_name, outcome).inc()
        self.ttft.observe(timings.ttft_ms / 1000)
        self.e2e.observe(timings.e2e_ms / 1000)
        gaps = timings.token_gaps_ms
        for gap in gaps:
            self.itl.observe(gap / 1000)
        if gaps:  # vLLM's: (e2e - ttft) / (tokens - 1), here over the tokens as they left the gateway
            self.tpot.observe(sum(gaps) / len(gaps) / 1000)
        for stage, child in self._stage_children.items():
            child.observe(getattr(timings, f"{stage}_ms") / 1000)
        self.queue_time.observe((timings.gateway_queue_ms + timings.prefill_queue_ms) / 1000)
        self.prefill_time.observe(timings.prefill_ms / 1000)
        self.decode_time.observe(timings.decode_ms / 1000)
        self.inference_time.observe((timings.prefill_ms + timings.decode_ms) / 1000)
        self.prompt_lengths.observe(num_prompt)
        self.output_lengths.observe(num_output)
        self.max_output_lengths.observe(num_output if num_longest_output is None else num_longest_output)
        self.params_n.observe(n)
        if max_tokens:
            self.params_max_tokens.observe(max_tokens)
        self.prompt_tokens.inc(num_prompt)
        self.output_tokens.inc(num_output)
        if num_preemptions:
            self.preemptions.inc(num_preemptions)
        self.transfer_bytes.inc(timings.transfer_bytes)

    def observe_ended(self, outcome: str, error_code: str = "") -> None:
        """A request that ended without finishing: "abort" (the client left) or "error" (with its cause)."""
        self._success.labels(self.model_name, outcome).inc()
        if error_code:
            self._request_errors.labels(self.model_name, error_code).inc()

    def observe_prefix_cache(self, worker_id: str, num_prompt: int, num_cached: int) -> None:
        self.prefix_cache_queries.labels(self.model_name, worker_id).inc(num_prompt)
        self.prefix_cache_hits.labels(self.model_name, worker_id).inc(num_cached)

    def observe_admission(self, num_waiting: int, reserved_tokens: int) -> None:
        """The admission line changed (gateway/requests/admission.py): kept current in every frontend, so
        a scrape answered by any of them sums every frontend's line."""
        self.admission_waiting.set(num_waiting)
        self.admission_reserved.set(reserved_tokens)

    def observe_http(self, handler: str, method: str, status: int) -> None:
        """One HTTP response (its route's template, not its path: the label set stays bounded)."""
        self._http.labels(self.model_name, handler, method, str(status)).inc()

    def render(self, fleet: FleetStatus) -> bytes:
        """The text exposition: this process's request and HTTP metrics (or, with several frontends, every
        frontend's, summed from prometheus_client's multiprocess files) and the fleet's series, whose
        num_requests_waiting counts the admission line (every frontend's) as its `gateway` row."""
        families = [family for source in self._sources for family in source.collect()]
        waiting_name = PREFIX + "admission_waiting_requests"
        self._fleet.status = fleet
        self._fleet.num_gateway_waiting = round(sum(
            sample.value for family in families if family.name == waiting_name for sample in family.samples))
        return generate_latest(_Families([*families, *self._fleet.collect()]))
