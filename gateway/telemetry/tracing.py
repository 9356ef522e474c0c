"""OpenTelemetry traces of finished requests (`--otlp-traces-endpoint`), built from their stage Timings.

Each finished request becomes one trace, or joins the caller's when its HTTP request carried a W3C
`traceparent` (and `tracestate`): a root span `llm_request` (kind SERVER, vLLM's name and `gen_ai.*`
attributes) from its arrival at the gateway to its last token leaving it, and under it one span per stage and
hop of the request's way, named as the `stage` label of `pdserve:request_stage_seconds`. The spans are made
when the request ends, from the durations in its Timings laid end to end from its arrival, all on the
gateway's clock (so clock skew between hosts cannot make a child start before its parent or overlap a
sibling). Requests that end in an error or an abort are not traced (as vLLM).

The SDK and the OTLP exporter are an optional extra (`pip install 'pdserve[otel]'`), imported only when the
flag is set. The exporter speaks OTLP over HTTP/protobuf unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL says
`grpc` (which needs opentelemetry-exporter-otlp-proto-grpc); the SDK's own OTEL_* variables (headers,
sampler, service name, batching) apply as usual. Spans leave in batches from the SDK's own thread, never
from the event loop.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from gateway.telemetry.timings import Timings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

INSTALL_HINT = "pip install 'pdserve[otel]'"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, as an incoming request carries it
ROOT_SPAN = "llm_request"
# The stages and hops in the order a request meets them. The decode worker's queue (waiting for blocks
# before the KV pull, and for the next step after it) is one duration in Timings: its span follows the pull.
STAGE_ORDER = ("gateway_queue", "to_prefill", "prefill_queue", "prefill", "handoff", "transfer",
               "decode_queue", "decode", "delivery")
# Every request has these (a stage of another path, e.g. the transfer of a prompt prefilled on its decode
# worker, is 0 and left out).
ALWAYS_TRACED = ("gateway_queue", "prefill", "decode")
_HTTP_TRACES_PATH = "/v1/traces"


@dataclass(frozen=True)
class TracedRequest:
    """What a request's trace says besides its Timings."""

    request_id: str  # the response's `id` (the id both workers know the request by)
    model_name: str  # the served model name
    arrival: float  # time.time() when the gateway received it: the root span's start
    num_prompt_tokens: int
    num_output_tokens: int  # every choice's
    max_tokens: int
    temperature: float
    top_p: float
    n: int  # choices
    trace_headers: tuple[tuple[str, str], ...] = ()  # the HTTP request's traceparent / tracestate


@dataclass(frozen=True)
class StageSpan:
    name: str  # a STAGE_ORDER name
    start_ms: float  # after the request's arrival
    duration_ms: float


def stage_spans(timings: Timings) -> list[StageSpan]:
    """The request's stages laid end to end from its arrival, each cut at the end of the request."""
    spans = []
    start = 0.0
    for name in STAGE_ORDER:
        duration = getattr(timings, f"{name}_ms")
        if duration <= 0 and name not in ALWAYS_TRACED:
            continue
        duration = max(0.0, min(duration, timings.e2e_ms - start))
        spans.append(StageSpan(name, start, duration))
        start += duration
    return spans


def trace_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The W3C trace context among an HTTP request's headers (case-insensitive mapping)."""
    return tuple((name, headers[name]) for name in TRACE_HEADERS if name in headers)


def _protocol() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                          os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))


def _exporter_module() -> str:
    kind = {"http/protobuf": "http", "grpc": "grpc"}.get(_protocol())
    if kind is None:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={_protocol()!r}: pdserve exports traces over "
                         "'http/protobuf' (default) or 'grpc'")
    return f"opentelemetry.exporter.otlp.proto.{kind}.trace_exporter"


def check_endpoint(endpoint: str) -> str:
    """The endpoint if traces can go there from this installation, else ValueError saying what to do."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{endpoint!r} is not an http:// or https:// URL of an OTLP collector, e.g. "
                         f"http://localhost:4318{_HTTP_TRACES_PATH}")
    module = _exporter_module()
    try:
        importlib.import_module("opentelemetry.sdk.trace")
        importlib.import_module(module)
    except ImportError as missing:
        grpc = " (and opentelemetry-exporter-otlp-proto-grpc for grpc)" if "grpc" in module else ""
        raise ValueError(f"traces need the OpenTelemetry SDK and OTLP exporter, which are not installed "
                         f"({missing}): {INSTALL_HINT}{grpc}") from None
    return endpoint


def _exporter(endpoint: str) -> Any:
    exporter_cls = importlib.import_module(_exporter_module()).OTLPSpanExporter
    if _protocol() == "grpc":
        return exporter_cls(endpoint=endpoint, insecure=endpoint.startswith("http://"))
    # OTLP/HTTP posts to the URL as given: a bare collector address means its standard traces path.
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + _HTTP_TRACES_PATH
    return exporter_cls(endpoint=endpoint)


class RequestTracer:
    """This gateway's tracer provider (one per app, not the process-wide global) and its exporter."""

    def __init__(self, endpoint: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        check_endpoint(endpoint)
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "pdserve"),
                                    "process.pid": os.getpid()})
        self._provider: TracerProvider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
        self._tracer = self._provider.get_tracer("pdserve.gateway")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER

    def record(self, request: TracedRequest, timings: Timings) -> None:
        """The request's root span and its stage spans (queued for export; returns at once)."""
        from opentelemetry import trace

        def ns(offset_ms: float) -> int:
            return int(request.arrival * 1e9) + int(offset_ms * 1e6)

        parent = self._propagator.extract(dict(request.trace_headers)) if request.trace_headers else None
        root = self._tracer.start_span(ROOT_SPAN, context=parent, kind=self._server_kind, start_time=ns(0),
                                       attributes=_root_attributes(request, timings))
        under_root = trace.set_span_in_context(root)
        for stage in stage_spans(timings):
            span = self._tracer.start_span(stage.name, context=under_root, start_time=ns(stage.start_ms))
            if stage.name == "transfer":
                span.set_attribute("pdserve.kv_transfer.bytes", timings.transfer_bytes)
            span.end(end_time=ns(stage.start_ms + stage.duration_ms))
        root.end(end_time=ns(timings.e2e_ms))

    def shutdown(self) -> None:
        """Export what is queued (bounded by the exporter's timeout) and stop the export thread."""
        self._provider.shutdown()


def _root_attributes(request: TracedRequest, timings: Timings) -> dict[str, Any]:
    """vLLM's `gen_ai.*` names (latencies in seconds), then ours."""
    return {
        "gen_ai.request.id": request.request_id,
        "gen_ai.response.model": request.model_name,
        "gen_ai.usage.prompt_tokens": request.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": request.num_output_tokens,
        "gen_ai.request.max_tokens": request.max_tokens,
        "gen_ai.request.temperature": request.temperature,
        "gen_ai.request.top_p": request.top_p,
        "gen_ai.request.n": request.n,
        "gen_ai.latency.time_in_queue": (timings.gateway_queue_ms + timings.prefill_queue_ms) / 1000,
        "gen_ai.latency.time_to_first_token": timings.ttft_ms / 1000,
        "gen_ai.latency.e2e": timings.e2e_ms / 1000,
        "gen_ai.latency.time_in_model_prefill": timings.prefill_ms / 1000,
        "gen_ai.latency.time_in_model_decode": timings.decode_ms / 1000,
        "pdserve.prefill_on": timings.prefill_on,
        "pdserve.cached_tokens": timings.cached_tokens,
        "pdserve.kv_transfer.bytes": timings.transfer_bytes,
        "pdserve.num_moves": timings.num_moves,
    }
