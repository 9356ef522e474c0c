"""Prometheus metrics of one gateway (its own registry: no module-level globals, one set per app).

Two kinds of series. The request path's (counters and histograms of finished requests, the admission line)
are this process's; with several frontends (--api-server-count) each writes them to prometheus_client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR, set by the supervisor before any frontend starts) and any
frontend's /metrics sums them all. The fleet's (workers per role, each worker's load and runtime, ratio
changes) are drawn at scrape time from the fleet's own status (gateway/telemetry/fleet_metrics.py), so they
are the same whichever frontend answers and a departed worker's series leave with it.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.telemetry.fleet_metrics import FleetCollector, FleetStatus
from gateway.telemetry.timings import Timings

# Latency buckets from 5 ms to 2 min: CPU decode steps are tens of ms, long CPU prefills tens of seconds.
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 120)
# A request's stages, and the hops between processes the stages leave out (see
# gateway/requests/stage_timings.py).
STAGES = ("gateway_queue", "prefill_queue", "prefill", "transfer", "decode_queue", "decode",
          "to_prefill", "handoff", "delivery")


def is_multiprocess() -> bool:
    """Whether this process is one of several frontends sharing the metrics files."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._fleet = FleetCollector()
        if is_multiprocess():  # this process's values are in the files, with every other frontend's
            self._exposed = CollectorRegistry()
            MultiProcessCollector(self._exposed)
        else:
            self._exposed = self.registry
        self._exposed.register(self._fleet)
        self.requests = Counter("pdserve_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=_SECONDS, registry=r)
        self.itl = Histogram(
            "pdserve_itl_seconds", "Gap between consecutive tokens", buckets=_SECONDS, registry=r
        )
        self.e2e = Histogram("pdserve_e2e_seconds", "Arrival to last token", buckets=_SECONDS, registry=r)
        self.stage = Histogram(
            "pdserve_stage_seconds", "Time spent in each stage", ["stage"], buckets=_SECONDS, registry=r
        )
        # Bound once: labels() takes a lock and builds a key, nine times per request otherwise.
        self._stage_children = {stage: self.stage.labels(stage) for stage in STAGES}
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.output_tokens = Counter("pdserve_output_tokens", "Generated tokens", registry=r)
        self.transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes", "KV bytes moved prefill→decode", registry=r
        )
        self.admission_waiting = Gauge(
            "pdserve_admission_waiting", "Requests waiting for decode KV capacity", registry=r,
            multiprocess_mode="livesum"
        )
        self.request_errors = Counter(
            "pdserve_request_errors", "Requests ended with an error, by cause", ["code"], registry=r
        )
        self.migrations = Counter(
            "pdserve_migrations", "Streams moved to another decode worker after a failure", registry=r
        )
        self.stalled_streams = Counter(
            "pdserve_stalled_streams", "Streams cut because the client stopped reading past the deadline",
            registry=r)
        # Per prefilling worker: a prefill worker, or a decode or mixed worker that prefilled for itself.
        self.prefix_cache_prompt_tokens = Counter(
            "pdserve_prefix_cache_prompt_tokens", "Prompt tokens prefilled", ["worker"], registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", ["worker"],
            registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache so far",
            ["worker"], registry=r, multiprocess_mode="mostrecent")  # each frontend's own rate
        self._prefix_totals: dict[str, tuple[int, int]] = {}  # worker → (prompt tokens, cached tokens)
        self.admission_reserved = Gauge(
            "pdserve_admission_reserved_tokens", "Decode KV tokens reserved", registry=r,
            multiprocess_mode="livesum"
        )

    def observe_request(self, timings: Timings, outcome: str, num_prompt: int, num_output: int) -> None:
        self.requests.labels(outcome).inc()
        self.ttft.observe(timings.ttft_ms / 1000)
        self.e2e.observe(timings.e2e_ms / 1000)
        for gap in timings.token_gaps_ms:
            self.itl.observe(gap / 1000)
        for stage, child in self._stage_children.items():
            child.observe(getattr(timings, f"{stage}_ms") / 1000)
        self.prompt_tokens.inc(num_prompt)
        self.output_tokens.inc(num_output)
        self.transfer_bytes.inc(timings.transfer_bytes)

    def observe_prefix_cache(self, worker_id: str, num_prompt: int, num_cached: int) -> None:
        self.prefix_cache_prompt_tokens.labels(worker_id).inc(num_prompt)
        self.prefix_cache_hit_tokens.labels(worker_id).inc(num_cached)
        total_prompt, total_cached = self._prefix_totals.get(worker_id, (0, 0))
        total_prompt, total_cached = total_prompt + num_prompt, total_cached + num_cached
        self._prefix_totals[worker_id] = (total_prompt, total_cached)
        self.prefix_cache_hit_rate.labels(worker_id).set(total_cached / max(1, total_prompt))

    def render(self, fleet: FleetStatus) -> bytes:
        """The text exposition: this process's request metrics (or, with several frontends, every
        frontend's, summed from prometheus_client's multiprocess files) and the fleet's series."""
        self._fleet.status = fleet
        return generate_latest(self._exposed)
