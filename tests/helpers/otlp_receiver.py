"""A real OTLP/HTTP trace receiver for tests: a local HTTP server that takes POST /v1/traces, decodes the
protobuf body (opentelemetry-proto's ExportTraceServiceRequest) and keeps every span it was sent."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

PATH = "/v1/traces"


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str  # hex, 32 digits
    span_id: str  # hex, 16 digits
    parent_span_id: str  # hex; "" for a root
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]


def _value(value: AnyValue) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


class OtlpReceiver:
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != PATH:
                    self.send_error(404)
                    return
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver._add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}{PATH}"

    def _add(self, request: ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(ReceivedSpan(
                        span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(), span.name,
                        span.kind, span.start_time_unix_nano, span.end_time_unix_nano,
                        _attributes(span.attributes), resource) for span in scope_spans.spans)

    def wait_for(self, trace_id: str, num_spans: int, timeout_s: float = 60.0) -> list[ReceivedSpan]:
        """The spans of trace `trace_id`, once at least `num_spans` have come (the SDK sends in batches)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = [span for span in self.spans if span.trace_id == trace_id]
            if len(found) >= num_spans or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def wait_for_root(self, request_id: str, timeout_s: float = 60.0) -> ReceivedSpan | None:
        """The root span of the request whose response `id` is `request_id`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                for span in self.spans:
                    if span.attributes.get("gen_ai.request.id") == request_id:
                        return span
            time.sleep(0.1)
        return None


@contextmanager
def receiving() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    thread = threading.Thread(target=receiver._server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver._server.shutdown()
        receiver._server.server_close()
