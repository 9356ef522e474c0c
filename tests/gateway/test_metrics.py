"""Gateway metrics: series follow the live workers (review L6)."""

from __future__ import annotations

from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.metrics import Metrics
from worker_runtime.load import WorkerLoad


def load(worker_id: str, role: str, running: int) -> WorkerLoad:
    return WorkerLoad(worker_id, role, num_waiting=0, num_queued_prompt_tokens=0, num_running=running,
                      num_transferring=0, num_free_blocks=90, num_total_blocks=100, num_outstanding_tokens=0)


def running_series(metrics: Metrics, loads: list[WorkerLoad]) -> dict[tuple[str, str], float]:
    text = metrics.render(FleetStatus(loads=loads)).decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("pdserve:num_requests_running{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            series[(labels["worker"].strip('"'), labels["role"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return series


def test_a_worker_that_changes_role_or_leaves_takes_its_old_series_with_it() -> None:
    metrics = Metrics("m")
    loads = [load("w0", "prefill", 2), load("w1", "decode", 3)]
    assert running_series(metrics, loads) == {("w0", "prefill"): 2, ("w1", "decode"): 3}
    # w0 changed role, w1 left
    assert running_series(metrics, [load("w0", "mixed", 1)]) == {("w0", "mixed"): 1}
