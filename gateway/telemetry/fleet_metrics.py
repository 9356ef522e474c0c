"""The fleet's series, drawn at scrape time from its status: workers per role, each live worker's load and
runtime, prompt tokens queued per pool, and the ratio controller's moves.

Nothing is kept between scrapes: a worker that left or changed role takes its old series with it (review
L6), and every frontend of a fleet renders the same series from the same status.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pool_worker import WorkerRuntime
from pool_worker.runtime.load import WorkerLoad


@dataclass(frozen=True)
class FleetStatus:
    loads: list[WorkerLoad] = field(default_factory=list)  # the live workers' (the pool watch's latest)
    runtimes: dict[str, WorkerRuntime] = field(default_factory=dict)  # worker id → how it computes
    active: dict[str, int] = field(default_factory=dict)  # role → active workers
    # (from role, to role, reason) → workers the ratio controller moved
    ratio_changes: dict[tuple[str, str, str], int] = field(default_factory=dict)


class FleetCollector(Collector):
    def __init__(self) -> None:
        self.status = FleetStatus()  # set before each scrape

    def collect(self) -> Iterator[Metric]:
        status = self.status
        workers = GaugeMetricFamily("pdserve_pool_workers", "Active workers by role", labels=["role"])
        for role, count in status.active.items():
            workers.add_metric([role], count)
        queued = GaugeMetricFamily("pdserve_queued_prompt_tokens", "Prompt tokens waiting per pool",
                                   labels=["pool"])
        for pool in ("prefill", "decode", "mixed"):
            queued.add_metric([pool], sum(x.num_queued_prompt_tokens for x in status.loads if x.role == pool))
        running = GaugeMetricFamily("pdserve_running_requests", "Requests computing per worker",
                                    labels=["worker", "role"])
        occupancy = GaugeMetricFamily("pdserve_kv_occupancy", "Fraction of KV blocks in use per worker",
                                      labels=["worker", "role"])
        for load in status.loads:
            running.add_metric([load.worker_id, load.role], load.num_running)
            occupancy.add_metric([load.worker_id, load.role], load.kv_occupancy)
        # How each worker computes (1 per live worker; the labels carry the facts, Prometheus' info idiom).
        runtime = GaugeMetricFamily("pdserve_worker_runtime_info",
                                    "A worker's dtype, GEMM kernel, decode attention, torch threads",
                                    labels=["worker", "dtype", "linear_kernel", "decode_attention",
                                            "threads"])
        speedup = GaugeMetricFamily("pdserve_linear_kernel_speedup",
                                    "Load-time probe: F.linear time over the chosen GEMM kernels'",
                                    labels=["worker"])
        for worker_id, facts in status.runtimes.items():
            runtime.add_metric([worker_id, facts.dtype, facts.linear_kernel, facts.decode_attention,
                                str(facts.num_threads)], 1)
            if facts.linear_kernel_speedup is not None:
                speedup.add_metric([worker_id], facts.linear_kernel_speedup)
        changes = CounterMetricFamily("pdserve_ratio_changes",
                                      "Workers moved between roles by the ratio controller",
                                      labels=["from", "to", "reason"])
        for (from_role, to_role, reason), count in status.ratio_changes.items():
            changes.add_metric([from_role, to_role, reason], count)
        yield from (workers, queued, running, occupancy, runtime, speedup, changes)
