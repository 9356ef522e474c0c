"""Prometheus metrics of one gateway (its own registry: no module-level globals, one set per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.telemetry.timings import Timings
from pool_worker import WorkerRuntime
from pool_worker.runtime.load import WorkerLoad

# Latency buckets from 5 ms to 2 min: CPU decode steps are tens of ms, long CPU prefills tens of seconds.
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 120)
# A request's stages, and the hops between processes the stages leave out (see
# gateway/requests/stage_timings.py).
STAGES = ("gateway_queue", "prefill_queue", "prefill", "transfer", "decode_queue", "decode",
          "to_prefill", "handoff", "delivery")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
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
        self.queued_prompt_tokens = Gauge(
            "pdserve_queued_prompt_tokens", "Prompt tokens waiting per pool", ["pool"], registry=r
        )
        self.running = Gauge(
            "pdserve_running_requests", "Requests computing per worker", ["worker", "role"], registry=r
        )
        self.kv_occupancy = Gauge(
            "pdserve_kv_occupancy", "Fraction of KV blocks in use per worker", ["worker", "role"], registry=r
        )
        self.admission_waiting = Gauge(
            "pdserve_admission_waiting", "Requests waiting for decode KV capacity", registry=r
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
        self.workers = Gauge("pdserve_pool_workers", "Active workers by role", ["role"], registry=r)
        self.ratio_changes = Counter(
            "pdserve_ratio_changes", "Workers moved between roles by the ratio controller",
            ["from", "to", "reason"], registry=r,
        )
        # Per prefilling worker: a prefill worker, or a decode or mixed worker that prefilled for itself.
        self.prefix_cache_prompt_tokens = Counter(
            "pdserve_prefix_cache_prompt_tokens", "Prompt tokens prefilled", ["worker"], registry=r)
        self.prefix_cache_hit_tokens = Counter(
            "pdserve_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", ["worker"],
            registry=r)
        self.prefix_cache_hit_rate = Gauge(
            "pdserve_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache so far",
            ["worker"], registry=r)
        self._load_series: set[tuple[str, str]] = set()  # (worker, role) of the last loads
        self._prefix_totals: dict[str, tuple[int, int]] = {}  # worker → (prompt tokens, cached tokens)
        self.admission_reserved = Gauge(
            "pdserve_admission_reserved_tokens", "Decode KV tokens reserved", registry=r
        )
        # How each worker computes (1 per live worker; the labels carry the facts, Prometheus' info idiom).
        self.worker_runtime = Gauge(
            "pdserve_worker_runtime_info", "A worker's dtype, GEMM kernel, decode attention, torch threads",
            ["worker", "dtype", "linear_kernel", "decode_attention", "threads"], registry=r)
        self.linear_kernel_speedup = Gauge(
            "pdserve_linear_kernel_speedup", "Load-time probe: F.linear time over the chosen GEMM kernels'",
            ["worker"], registry=r)

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

    def set_loads(self, loads: list[WorkerLoad]) -> None:
        for pool in ("prefill", "decode", "mixed"):
            self.queued_prompt_tokens.labels(pool).set(
                sum(x.num_queued_prompt_tokens for x in loads if x.role == pool)
            )
        # One series per live worker in its current role: a worker that left or changed role takes its old
        # series with it, instead of leaving them frozen at their last value (review L6).
        series = {(load.worker_id, load.role) for load in loads}
        for gone in self._load_series - series:
            self.running.remove(*gone)
            self.kv_occupancy.remove(*gone)
        self._load_series = series
        for load in loads:
            self.running.labels(load.worker_id, load.role).set(load.num_running)
            self.kv_occupancy.labels(load.worker_id, load.role).set(load.kv_occupancy)

    def set_runtimes(self, runtimes: dict[str, WorkerRuntime]) -> None:
        """One series per live worker: a departed worker's series leave with it."""
        self.worker_runtime.clear()
        self.linear_kernel_speedup.clear()
        for worker_id, runtime in runtimes.items():
            self.worker_runtime.labels(worker_id, runtime.dtype, runtime.linear_kernel,
                                       runtime.decode_attention, str(runtime.num_threads)).set(1)
            if runtime.linear_kernel_speedup is not None:
                self.linear_kernel_speedup.labels(worker_id).set(runtime.linear_kernel_speedup)

    def render(self) -> bytes:
        return generate_latest(self.registry)
