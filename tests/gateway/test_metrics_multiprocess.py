"""Several frontends (--api-server-count), without Ray: two processes write their series to
prometheus_client's multiprocess files as frontends do, a third renders /metrics' text. vLLM's HTTP series
(prometheus-fastapi-instrumentator's) are summed over both like ours, and so is each frontend's admission
line, in num_requests_waiting's gateway row too. (The live multi-frontend server:
tests/gateway/test_frontends.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]

FRONTEND = """
from fastapi import FastAPI
from fastapi.testclient import TestClient
from gateway.api.http_metrics import instrument_http
from gateway.telemetry.metrics import Metrics

app = FastAPI()

@app.post("/v1/completions")
async def completions() -> dict[str, str]:
    return {}

metrics = Metrics("m", http_registry=instrument_http(app))
with TestClient(app) as client:
    assert client.post("/v1/completions").status_code == 200
    assert client.get("/v1/nothing-here").status_code == 404
metrics.observe_admission(num_waiting=1, reserved_tokens=10)  # one request in this frontend's line
"""

SCRAPE = """
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.metrics import Metrics

print(Metrics("m").render(FleetStatus()).decode())
"""


def run(code: str, metrics_dir: Path) -> str:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_two_frontends_http_series_and_admission_lines_are_summed(tmp_path: Path) -> None:
    for _ in range(2):
        run(FRONTEND, tmp_path)
    text = run(SCRAPE, tmp_path)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert value("http_requests_total", handler="/v1/completions", method="POST", status="2xx") == 2
    assert value("http_requests_total", handler="none", method="GET", status="4xx") == 2
    assert value("http_request_duration_seconds_count", handler="/v1/completions", method="POST") == 2
    assert value("pdserve:admission_waiting_requests", model_name="m") == 2
    assert value("pdserve:num_requests_waiting", model_name="m", worker="gateway", role="gateway") == 2
