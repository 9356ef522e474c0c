"""/metrics of a real server after a few requests: every series is in the list kept in the repo
(gateway/telemetry/metric_names.py) with its labels and `model_name`, counts match what was served,
docs/metrics.md names every series, the Grafana dashboard asks only for series the server exports, and
/metrics needs no key (unless --metrics-require-key: tests/gateway/test_security.py).
X-Request-Id: a client's value comes back and names the request; one is minted when absent."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api.request_id import current_request_id, install_log_prefix
from gateway.telemetry.metric_names import ALL_METRICS, MODEL_LABEL, MetricName
from tests.helpers.servers import API_KEY, MODEL, burst, wait_until_no_blocks_used

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
TARGET_LABELS = ("job", "instance")  # the labels Prometheus adds to every series it scrapes
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: httpx.Client) -> tuple[str, Samples]:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {(s.name, frozenset(s.labels.items())): s.value
               for family in text_string_to_metric_families(response.text) for s in family.samples}
    return response.text, samples


def listed(sample_name: str) -> MetricName | None:
    """The listed series a scraped sample belongs to (a histogram's _bucket, _sum, _count included)."""
    for metric in ALL_METRICS:
        if sample_name == metric.name or (metric.kind == "histogram" and any(
                sample_name == metric.name + suffix for suffix in HISTOGRAM_SUFFIXES)):
            return metric
    return None


def serve_a_few(client: httpx.Client) -> None:
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert client.post("/v1/completions", json={**greedy, "prompt": [5, 6, 7]}).status_code == 200
    streaming = {**greedy, "prompt": [8, 9, 10, 11, 12], "stream": True}
    with client.stream("POST", "/v1/completions", json=streaming) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()
    chat = {**greedy, "messages": [{"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert wait_until_no_blocks_used(client) == 0


@pytest.fixture(scope="module")
def served(server: str) -> tuple[str, Samples, Samples]:
    """The exposition text before and after a few requests: (text after, samples before, samples after)."""
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        _, before = scrape(client)
        serve_a_few(client)
        text, after = scrape(client)
    return text, before, after


def test_every_series_is_listed_with_its_labels_and_the_model_name(served: tuple[str, Samples, Samples]
                                                                   ) -> None:
    text, _, after = served
    exported = {name for name, _ in after if name.startswith("pdserve")}
    unlisted = sorted(name for name in exported if listed(name) is None)
    assert not unlisted, f"exported but not in gateway/telemetry/metric_names.py: {unlisted}"
    for name, labels in after:
        metric = listed(name)
        if metric is None:
            continue
        names = dict(labels)
        assert names.pop(MODEL_LABEL, None) == MODEL, (name, labels)
        names.pop("le", None)
        assert set(names) == set(metric.labels), (name, labels)
    # Every listed series is declared (labelled ones with no sample yet still have their HELP line).
    declared = set(re.findall(r"^# HELP (\S+) ", text, re.MULTILINE))
    missing = [m.name for m in ALL_METRICS
               if m.name not in declared and m.name.removesuffix("_total") not in declared]
    assert not missing, f"listed but not exported: {missing}"


def test_counts_follow_what_was_served(served: tuple[str, Samples, Samples]) -> None:
    _, before, after = served

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset({MODEL_LABEL: MODEL, **labels}.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("pdserve:request_success_total", finished_reason="length") == 3
    assert grew("pdserve:generation_tokens_total") == 3 * 4
    assert grew("pdserve:prompt_tokens_total") >= 3 + 5 + 1  # and the chat prompt's template tokens
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                      "request_time_per_output_token_seconds", "request_queue_time_seconds",
                      "request_prefill_time_seconds", "request_decode_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert grew(f"pdserve:{histogram}_count") == 3, histogram
    assert grew("pdserve:inter_token_latency_seconds_count") >= 3  # steps may coalesce gaps
    for stage in ("gateway_queue", "prefill", "transfer", "decode"):
        assert grew("pdserve:request_stage_seconds_count", stage=stage) == 3, stage
    http = "pdserve:http_requests_total"
    assert grew(http, handler="/v1/completions", method="POST", status="200") == 2
    assert grew(http, handler="/v1/chat/completions", method="POST", status="200") == 1
    assert grew("pdserve:num_preemptions_total") == 0  # small requests, no KV pressure


def test_refusals_are_counted_by_status(server: str, served: tuple[str, Samples, Samples]) -> None:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        _, before = scrape(client)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{server}/v1/completions", json=body).status_code == 401  # no key
        assert client.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404
        assert client.get("/v1/no-such-route").status_code == 404
        # As in test_http_api: of four 460-token requests two run, one waits, one is turned away.
        overload = {"model": MODEL, "prompt": [3] * 10, "max_tokens": 450, "temperature": 0,
                    "ignore_eos": True}
        assert sorted(r.status_code for r in burst(server, overload, 4)) == [200, 200, 200, 429]
        assert wait_until_no_blocks_used(client) == 0
        _, after = scrape(client)

    def grew(status: str, handler: str = "/v1/completions", method: str = "POST") -> float:
        key = ("pdserve:http_requests_total", frozenset({MODEL_LABEL: MODEL, "handler": handler,
                                                         "method": method, "status": status}.items()))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("401") == 1 and grew("404") == 1 and grew("429") == 1
    assert grew("404", handler="none", method="GET") == 1  # the route's template, never the raw path


def test_metrics_are_open_without_the_api_key_by_default(server: str) -> None:
    # This server wants an API key on /v1 (tests/helpers/servers.py); scrapers send none.
    assert httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    response = httpx.get(f"{server}/metrics", timeout=60)
    assert response.status_code == 200 and "pdserve:time_to_first_token_seconds" in response.text
    openapi = httpx.get(f"{server}/openapi.json", timeout=60).json()
    assert "security" not in openapi["paths"]["/metrics"]["get"]


def test_the_docs_metrics_table_is_the_list() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    section = page[page.index("# Metrics reference"):page.index("**Grafana**")]
    # | `pdserve:name` | kind | `label`, `label` (or —) | vLLM's | what |
    rows = re.findall(r"^\| `(pdserve:[a-z0-9_:]+)` \| (\w+) \| ([^|]*) \|", section, re.MULTILINE)
    table = {name: (kind, set(re.findall(r"`(\w+)`", labels))) for name, kind, labels in rows}
    assert table == {m.name: (m.kind, set(m.labels)) for m in ALL_METRICS}


def test_the_dashboard_asks_only_for_exported_series_and_labels(served: tuple[str, Samples, Samples]) -> None:
    _, _, after = served
    labels_of: dict[str, set[str]] = {}
    for name, labels in after:
        labels_of.setdefault(name, set()).update(key for key, _ in labels)
    for metric in ALL_METRICS:  # labelled series with no sample yet (no error so far): their listed labels
        names = [metric.name + s for s in HISTOGRAM_SUFFIXES] if metric.kind == "histogram" else [metric.name]
        for name in names:
            labels_of.setdefault(name, set()).update({MODEL_LABEL, *metric.labels})
            if name.endswith("_bucket"):
                labels_of[name].add("le")
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    assert len(exprs) > 20
    used: set[str] = set()
    for expr in exprs:
        names = re.findall(r"pdserve:[A-Za-z0-9_:]+", expr)
        assert names, expr
        used.update(names)
        for name in names:
            assert name in labels_of, f"{name} (in {expr!r}) is not exported"
        for name, matchers in re.findall(r"(pdserve:[A-Za-z0-9_:]+)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*[=!]~?", matchers):
                if label in TARGET_LABELS:
                    continue
                assert label in labels_of[name], f"{name} has no label {label} (in {expr!r})"
        known = set().union(*(labels_of[n] for n in names))
        for group in re.findall(r"by \(([^)]*)\)", expr):
            for label in (x.strip() for x in group.split(",")):
                assert label in known, f"no series in {expr!r} has the label {label}"
    # The PD picture: TTFT/ITL, stages, queues per pool, KV per worker, the layout and its changes.
    for wanted in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "request_stage_seconds_sum", "queued_prompt_tokens", "kv_cache_usage_perc", "pool_workers",
                   "ratio_changes_total"):
        assert f"pdserve:{wanted}" in used, wanted


def test_every_panel_selects_the_dashboards_job_and_instance() -> None:
    # Two deployments of one model (two gateways, two clusters) stay apart.
    dashboard = json.loads(DASHBOARD.read_text())
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "job", "instance", "model_name"]
    for expr in (t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])):
        for label in (*TARGET_LABELS, MODEL_LABEL):
            assert f'{label}=~"${label}"' in expr, (label, expr)


def test_a_clients_request_id_comes_back_and_names_the_request(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    given = "trace-4bf92f3577b34da6a3ce929d0e0e4736"
    whole = client.post("/v1/completions", json=body, headers={"X-Request-Id": given})
    assert whole.status_code == 200 and whole.headers["x-request-id"] == given
    assert whole.json()["id"].startswith(f"{given}-")  # unique on the workers even if a client reuses it
    with client.stream("POST", "/v1/completions", json={**body, "stream": True},
                       headers={"X-Request-Id": given}) as streamed:
        assert streamed.headers["x-request-id"] == given
        assert f'"id":"{given}-' in streamed.read().decode()


def test_a_request_id_is_minted_when_absent_and_on_errors(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    minted = client.post("/v1/completions", json=body)
    assert minted.headers["x-request-id"] == minted.json()["id"]  # one id, minted here
    refused = client.post("/v1/completions", json={**body, "model": "nope"})
    assert refused.status_code == 404 and refused.headers["x-request-id"].startswith("req-")
    assert client.get("/v1/models").headers["x-request-id"]
    assert "x-request-id" not in client.get("/health").headers  # /v1 only


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", 'quote"d', "back\\slash", "tab\tbed"])
def test_a_bad_request_id_is_refused(client: httpx.Client, bad: str) -> None:
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    refused = client.post("/v1/completions", json=body, headers={"X-Request-Id": bad})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "X-Request-Id"
    assert refused.headers["x-request-id"].startswith("req-")


def test_log_lines_made_while_a_request_is_served_carry_its_id(caplog: pytest.LogCaptureFixture) -> None:
    install_log_prefix()
    install_log_prefix()  # idempotent: one prefix
    logger = logging.getLogger("gateway.test")
    token = current_request_id.set("trace-1")
    try:
        logger.warning("a worker failed: %s", "boom")
    finally:
        current_request_id.reset(token)
    logger.warning("outside any request")
    assert [r.getMessage() for r in caplog.records] == ["[trace-1] a worker failed: boom",
                                                        "outside any request"]
