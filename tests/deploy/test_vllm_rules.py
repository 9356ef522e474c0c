"""The recording rules that give pdserve's series vLLM's names (deploy/prometheus/vllm-names.rules.yaml and
the PrometheusRule of deploy/kuberay/monitoring/): what gateway/telemetry/vllm_rules.py generates, one rule
per vLLM twin's sample series, valid for promtool, and enough for vLLM's example dashboard
(tests/fixtures/vllm_grafana/grafana.json, unmodified): each of its queries returns data over two in-process
scrapes of the gateway's metrics, and none does without the rules. The same against a live server:
tests/gateway/test_vllm_dashboard.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from gateway.telemetry import vllm_rules
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.metric_names import ALL_METRICS
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.timings import Timings
from tests.helpers.prometheus import (
    INSTANCE,
    JOB,
    NO_PROMTOOL,
    PROMTOOL,
    RULES,
    VLLM_DASHBOARD,
    failing_queries,
    grafana_expr,
    panel_queries,
)
from worker_runtime.load import WorkerLoad

ROOT = Path(__file__).resolve().parents[2]
MODEL = "some-org/some-model"
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)


def test_the_files_are_what_the_generator_writes() -> None:
    assert (ROOT / vllm_rules.RULES_FILE).read_text() == vllm_rules.rules_file_text(), (
        "regenerate: python -m gateway.telemetry.vllm_rules")
    assert (ROOT / vllm_rules.PROMETHEUS_RULE).read_text() == vllm_rules.prometheus_rule_text()
    plain = yaml.safe_load((ROOT / vllm_rules.RULES_FILE).read_text())
    operator = yaml.safe_load((ROOT / vllm_rules.PROMETHEUS_RULE).read_text())
    assert operator["kind"] == "PrometheusRule" and operator["spec"]["groups"] == plain["groups"]


def test_every_vllm_twin_is_recorded_from_its_pdserve_series() -> None:
    [group] = yaml.safe_load(RULES.read_text())["groups"]
    recorded = {rule["record"]: rule["expr"] for rule in group["rules"]}
    for metric in (m for m in ALL_METRICS if m.vllm):
        suffixes = ("_bucket", "_sum", "_count") if metric.kind == "histogram" else ("",)
        for suffix in suffixes:
            assert metric.name + suffix in recorded[metric.vllm + suffix], metric
            assert ("engine" in recorded[metric.vllm + suffix]) == ("worker" in metric.labels)
    assert len(recorded) == len(group["rules"])  # no name recorded twice


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([str(PROMTOOL), "check", "rules", str(RULES)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def load(worker_id: str, role: str, running: int, waiting: int) -> WorkerLoad:
    return WorkerLoad(worker_id, role, num_waiting=waiting, num_queued_prompt_tokens=0, num_running=running,
                      num_transferring=0, num_free_blocks=60, num_total_blocks=100, num_outstanding_tokens=0)


def timings(ttft_ms: float, e2e_ms: float) -> Timings:
    return Timings(gateway_queue_ms=1, prefill_queue_ms=2, prefill_ms=ttft_ms / 2, transfer_ms=3,
                   transfer_bytes=4096, decode_queue_ms=1, decode_ms=e2e_ms - ttft_ms, ttft_ms=ttft_ms,
                   e2e_ms=e2e_ms, token_gaps_ms=[25.0] * 7)


def in_process_scrapes() -> list[str]:
    """The gateway's /metrics text before and after three requests, with a prefill and a decode worker."""
    metrics = Metrics(MODEL, max_model_len=2048)
    status = FleetStatus(loads=[load("p0", "prefill", 0, 0), load("d0", "decode", 2, 1)],
                         active={"prefill": 1, "decode": 1})
    metrics.observe_prefix_cache("p0", 30, 0)  # the worker's series exist before: rate() sees them grow
    before = metrics.render(status).decode()
    for ttft_ms, e2e_ms in ((40, 400), (60, 700), (80, 1500)):
        metrics.observe_request(timings(ttft_ms, e2e_ms), "length", num_prompt=30, num_output=8, n=1,
                                max_tokens=8)
        metrics.observe_prefix_cache("p0", 30, 16)
    return [before, metrics.render(status).decode()]


def vllm_dashboard_exprs() -> list[str]:
    board = json.loads(VLLM_DASHBOARD.read_text())
    # Its one query variable, as Grafana fills it: any series' model_name (pdserve's carry the served name).
    assert [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"] == [
        "label_values(model_name)"]
    queries = panel_queries(VLLM_DASHBOARD)
    assert len({q.panel for q in queries}) == 12 and all("vllm:" in q.expr for q in queries)
    return [grafana_expr(q.expr, {"model_name": MODEL}) for q in queries]


@needs_promtool
def test_vllms_dashboard_reads_an_in_process_scrape_through_the_rules(tmp_path: Path) -> None:
    exprs = vllm_dashboard_exprs()
    scrapes = in_process_scrapes()
    assert failing_queries(scrapes, exprs, tmp_path) == []
    # Without the rules none does: the data comes through them, not from a vllm: series of the scrape.
    no_rules = tmp_path / "none.rules.yaml"
    no_rules.write_text("groups: []\n")
    assert failing_queries(scrapes, exprs[:3], tmp_path, rules=no_rules) == exprs[:3]


@needs_promtool
def test_pdserves_own_dashboard_parses_and_reads_the_scrape(tmp_path: Path) -> None:
    # Its queries, job and instance picked as Grafana would: all parse (promtool runs them), and all return
    # data but those of series an in-process scrape (no error, no HTTP middleware, no ratio move) lacks.
    variables = {"job": JOB, "instance": INSTANCE, "model_name": MODEL}
    queries = panel_queries(ROOT / "deploy" / "grafana" / "pdserve-dashboard.json")
    exprs = [grafana_expr(q.expr, variables) for q in queries]
    failing = failing_queries(in_process_scrapes(), exprs, tmp_path)
    unseen = ("pdserve:ratio_changes_total", "pdserve:request_errors_total", "pdserve:http_requests_total")
    assert failing and all(any(name in expr for name in unseen) for expr in failing), failing
