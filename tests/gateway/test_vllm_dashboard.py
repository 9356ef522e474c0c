"""vLLM's example Grafana dashboard against a live server, unchanged: two scrapes of /metrics (before and
after a few requests) replayed into a real Prometheus (promtool) with deploy/prometheus/vllm-names.rules.yaml,
and every query of tests/fixtures/vllm_grafana/grafana.json returns data; so do an autoscaling rule's
`sum(vllm:num_requests_waiting)` (the admission line is its engine="gateway" row) and the HTTP series in the
shape vLLM's overview dashboard reads (prometheus-fastapi-instrumentator's, status "2xx")."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.telemetry.metric_names import HTTP_METRICS
from tests.helpers.prometheus import (
    INSTANCE,
    JOB,
    NO_PROMTOOL,
    PROMTOOL,
    VLLM_DASHBOARD,
    failing_queries,
    grafana_expr,
    panel_queries,
)
from tests.helpers.servers import API_KEY, MODEL, wait_until_no_blocks_used

pytestmark = [pytest.mark.slow, pytest.mark.skipif(PROMTOOL is None, reason=NO_PROMTOOL)]

# Beside the dashboard's: what an autoscaler and vLLM's overview dashboard ask, through the rules or as is.
MORE_QUERIES = (
    "sum(vllm:num_requests_waiting)",
    'vllm:num_requests_waiting{engine="gateway"}',
    'sum by (engine) (vllm:num_requests_running{engine!="gateway"})',
    "histogram_quantile(0.5, sum by (le, engine) (rate(vllm:iteration_tokens_total_bucket[5m])))",
    'sum by (handler) (rate(http_requests_total{handler="/v1/completions", method="POST", status="2xx"}'
    '[5m]))',
    "sum(rate(http_requests_total[5m]))",
    "histogram_quantile(0.9, sum by (le) (rate(http_request_duration_seconds_bucket[5m])))",
    "rate(http_request_duration_highr_seconds_sum[5m]) / rate(http_request_duration_highr_seconds_count[5m])",
    # vLLM's overview dashboard's "5xx ratio" (examples/observability/dashboards/grafana/vllm_overview.json).
    '(sum(rate(http_requests_total{job=~"$job", instance=~"$instance", status="5xx"}[$__rate_interval])) or '
    'vector(0)) / (sum(rate(http_requests_total{job=~"$job", instance=~"$instance"}[$__rate_interval])) > 0)',
    # Its "Engines": one per worker (the gateway row is only in num_requests_waiting).
    'count(vllm:num_requests_running{job=~"$job", model_name=~"$model_name", instance=~"$instance"})',
)


def steps(text: str) -> float:
    """Forwards counted by every worker (pdserve:iteration_tokens_total's counts)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == "pdserve:iteration_tokens_total_count")


def serve_a_few(client: httpx.Client) -> None:
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json={**greedy, "prompt": [5, 6, 7]}).status_code == 200
    with client.stream("POST", "/v1/completions",
                       json={**greedy, "prompt": [8, 9, 10, 11, 12], "stream": True}) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
    chat = {**greedy, "messages": [{"role": "user", "content": "Hi"}], "n": 2}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert wait_until_no_blocks_used(client) == 0


def test_vllms_example_dashboard_reads_a_live_server_through_the_rules(server: str, tmp_path: Path) -> None:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        # First traffic, then the window: as a scraper running all along sees them, the HTTP series' label
        # sets (born with a route's first request) exist before the window and grow in it.
        serve_a_few(client)
        before = client.get("/metrics").text
        serve_a_few(client)
        # The workers' series come from the pool watch's latest round (each second): wait for a newer one.
        deadline = time.monotonic() + 10
        while (after := client.get("/metrics").text) and steps(after) <= steps(before):
            assert time.monotonic() < deadline, "the workers' step counts did not grow"
            time.sleep(0.2)
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(after) for s in family.samples}
    handled = ("http_requests_total",
               frozenset({"handler": "/v1/completions", "method": "POST", "status": "2xx"}.items()))
    assert samples.get(handled, 0) >= 2  # vLLM's shape beside ours (pdserve:http_requests_total)
    declared = set(re.findall(r"^# HELP (\S+) ", after, re.MULTILINE))
    for metric in HTTP_METRICS:  # named and labelled as the list (and docs/metrics.md) say
        assert declared & {metric.name, metric.name.removesuffix("_total")}, metric.name
        labels = {key for (name, labelled), _ in samples.items() if name.startswith(metric.name.removesuffix(
            "_total")) for key, _ in labelled} - {"le", "quantile"}
        assert labels == set(metric.labels), (metric.name, labels)
    variables = {"model_name": MODEL, "job": JOB, "instance": INSTANCE}
    exprs = [grafana_expr(q.expr, variables) for q in panel_queries(VLLM_DASHBOARD)]
    exprs += [grafana_expr(expr, variables) for expr in MORE_QUERIES]
    failing = failing_queries([before, after], exprs, tmp_path)
    assert failing == [], "\n".join(failing)
