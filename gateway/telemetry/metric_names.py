"""Every series pdserve exports on /metrics: its name, kind and labels, kept here as a list so that a test can
hold the server (a real scrape), the README's metrics reference and the Grafana dashboard to it.

Names follow vLLM's (`vllm:time_to_first_token_seconds` → `pdserve:time_to_first_token_seconds`), so that
the dashboards and autoscaling rules people run for vLLM work after a change of prefix; every series has a
`model_name` label (the served model name), as vLLM's do. The series vLLM has no name for (stages, KV
transfer, pools, ratio changes) use the same prefix and label. Counters are listed with their `_total`.
deploy/prometheus/vllm-names.rules.yaml re-exposes every series with a `vllm` twin under that name.

HTTP_METRICS are prometheus-fastapi-instrumentator's (gateway/api/http_metrics.py), named and labelled as
vLLM's server has them: no prefix, no model_name.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "pdserve:"
MODEL_LABEL = "model_name"


@dataclass(frozen=True)
class MetricName:
    name: str  # as scraped (counters with _total; a histogram's samples add _bucket, _sum, _count)
    kind: str  # "counter", "gauge", "histogram" or "summary"
    labels: tuple[str, ...]  # besides model_name (and a histogram's le)
    vllm: str = ""  # vLLM's series of the same meaning, when it has one


def _m(name: str, kind: str, labels: tuple[str, ...] = (), vllm: str = "") -> MetricName:
    return MetricName(PREFIX + name, kind, labels, vllm and "vllm:" + vllm)


# The request path's (gateway/telemetry/metrics.py), summed over the frontends with --api-server-count N.
REQUEST_METRICS = (
    _m("time_to_first_token_seconds", "histogram", vllm="time_to_first_token_seconds"),
    _m("inter_token_latency_seconds", "histogram", vllm="inter_token_latency_seconds"),
    _m("request_time_per_output_token_seconds", "histogram", vllm="request_time_per_output_token_seconds"),
    _m("e2e_request_latency_seconds", "histogram", vllm="e2e_request_latency_seconds"),
    _m("request_queue_time_seconds", "histogram", vllm="request_queue_time_seconds"),
    _m("request_prefill_time_seconds", "histogram", vllm="request_prefill_time_seconds"),
    _m("request_decode_time_seconds", "histogram", vllm="request_decode_time_seconds"),
    _m("request_prompt_tokens", "histogram", vllm="request_prompt_tokens"),
    _m("request_generation_tokens", "histogram", vllm="request_generation_tokens"),
    _m("request_max_num_generation_tokens", "histogram", vllm="request_max_num_generation_tokens"),
    _m("request_params_n", "histogram", vllm="request_params_n"),
    _m("request_params_max_tokens", "histogram", vllm="request_params_max_tokens"),
    _m("request_inference_time_seconds", "histogram", vllm="request_inference_time_seconds"),
    _m("request_stage_seconds", "histogram", ("stage",)),
    _m("request_success_total", "counter", ("finished_reason",), vllm="request_success_total"),
    _m("prompt_tokens_total", "counter", vllm="prompt_tokens_total"),
    _m("generation_tokens_total", "counter", vllm="generation_tokens_total"),
    _m("num_preemptions_total", "counter", vllm="num_preemptions_total"),
    _m("prefix_cache_queries_total", "counter", ("worker",), vllm="prefix_cache_queries_total"),
    _m("prefix_cache_hits_total", "counter", ("worker",), vllm="prefix_cache_hits_total"),
    _m("kv_transfer_bytes_total", "counter"),
    _m("request_errors_total", "counter", ("code",)),
    _m("migrations_total", "counter"),
    _m("stalled_streams_total", "counter"),
    _m("admission_waiting_requests", "gauge"),
    _m("admission_reserved_tokens", "gauge"),
    _m("http_requests_total", "counter", ("handler", "method", "status")),
)

# The fleet's (gateway/telemetry/fleet_metrics.py), drawn from its status at scrape time.
FLEET_METRICS = (
    _m("num_requests_running", "gauge", ("worker", "role"), vllm="num_requests_running"),
    _m("num_requests_waiting", "gauge", ("worker", "role"), vllm="num_requests_waiting"),
    _m("kv_cache_usage_perc", "gauge", ("worker", "role"), vllm="kv_cache_usage_perc"),
    _m("iteration_tokens_total", "histogram", ("worker", "role"), vllm="iteration_tokens_total"),
    _m("pool_workers", "gauge", ("role",)),
    _m("queued_prompt_tokens", "gauge", ("pool",)),
    _m("worker_runtime_info", "gauge",
       ("worker", "dtype", "weights", "kv_dtype", "linear_kernel", "decode_attention", "compile", "threads")),
    _m("linear_kernel_speedup", "gauge", ("worker",)),
    _m("ratio_changes_total", "counter", ("from", "to", "reason")),
    _m("scale_changes_total", "counter", ("reason",)),
)

ALL_METRICS = REQUEST_METRICS + FLEET_METRICS

# prometheus-fastapi-instrumentator's, as vLLM's (no model_name; status grouped as "2xx", "5xx").
HTTP_METRICS = (
    MetricName("http_requests_total", "counter", ("handler", "method", "status")),
    MetricName("http_request_duration_seconds", "histogram", ("handler", "method")),
    MetricName("http_request_duration_highr_seconds", "histogram", ()),
    MetricName("http_request_size_bytes", "summary", ("handler",)),
    MetricName("http_response_size_bytes", "summary", ("handler",)),
)
