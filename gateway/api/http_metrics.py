"""HTTP series in the shape vLLM's dashboards query: prometheus-fastapi-instrumentator's, set up as vLLM's
server sets it up (vllm/entrypoints/serve/instrumentator/metrics.py: its excluded handlers, its defaults).

    http_requests_total{handler, method, status}         status grouped: "2xx", "4xx", "5xx"
    http_request_duration_seconds{handler, method}       few buckets (0.1, 0.5, 1)
    http_request_duration_highr_seconds                  many buckets, no labels
    http_request_size_bytes{handler}, http_response_size_bytes{handler}   summaries (sum and count)

`handler` is the route's template ("none" for a path no route matches); a streamed response's duration runs
to its last byte. No `model_name` label: vLLM's have none. pdserve's own pdserve:http_requests_total
(gateway/api/http_counts.py) stays beside them, with exact codes (429 is load shed) and model_name.

The series live in a registry of their own, made here for the app: the middleware creates them when the app
starts, before the lifespan has built the gateway's Metrics, which renders them on /metrics (with several
frontends, summed from the multiprocess files like every other series of the process).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import Instrumentator

# vLLM's list: scrapes, probes and the version are not traffic.
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")


def instrument_http(app: FastAPI) -> CollectorRegistry:
    """Add the instrumentator's middleware (outermost of those added so far); returns its registry."""
    registry = CollectorRegistry()
    Instrumentator(excluded_handlers=list(EXCLUDED_HANDLERS), registry=registry).instrument(app)
    return registry
