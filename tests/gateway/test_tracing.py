"""OpenTelemetry traces (--otlp-traces-endpoint) sent by a real server to a real OTLP/HTTP receiver: a root
span per request with vLLM's attributes, under the caller's trace when it sent a W3C traceparent, and a child
span per stage laid out from the response's own Timings. Without the SDK installed, the flag is refused at
start saying what to install."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from pydantic import ValidationError

from gateway.config import ServeConfig
from gateway.telemetry.timings import Timings
from gateway.telemetry.tracing import ALWAYS_TRACED, INSTALL_HINT, ROOT_SPAN, STAGE_ORDER, stage_spans
from tests.helpers.otlp_receiver import OtlpReceiver, ReceivedSpan, receiving
from tests.helpers.servers import API_KEY, MODEL, serve_config, serving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


@pytest.fixture(scope="module")
def traced(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[tuple[httpx.Client, OtlpReceiver]]:
    with receiving() as receiver:
        config = serve_config(tiny_chat_model_dir, otlp_traces_endpoint=receiver.url)
        key = {"Authorization": f"Bearer {API_KEY}"}
        with serving(config) as (url, _), httpx.Client(base_url=url, timeout=120, headers=key) as client:
            yield client, receiver


def check_stage_spans(spans: list[ReceivedSpan], root: ReceivedSpan, timings: Timings) -> None:
    """The stage spans are the root's children, in the order a request meets its stages, end to end within
    the root, as the request's Timings lay them out."""
    children = sorted((s for s in spans if s.parent_span_id == root.span_id), key=lambda s: s.start_ns)
    assert [s.name for s in children] == [s.name for s in stage_spans(timings)]
    assert set(ALWAYS_TRACED) <= {s.name for s in children}
    assert [s.name for s in children] == [n for n in STAGE_ORDER if n in {s.name for s in children}]
    assert all(s.trace_id == root.trace_id and s.kind == Span.SPAN_KIND_INTERNAL for s in children)
    assert children[0].start_ns == root.start_ns
    for earlier, later in itertools.pairwise(children):
        assert earlier.start_ns <= earlier.end_ns <= later.start_ns
    assert children[-1].end_ns <= root.end_ns


def test_a_request_joins_the_callers_trace_with_a_span_per_stage(traced: tuple[httpx.Client, OtlpReceiver]
                                                                 ) -> None:
    client, receiver = traced
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/completions", json=body,
                           headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"})
    assert response.status_code == 200, response.text
    answer = response.json()
    timings = Timings(**answer["timings"])
    num_children = len(stage_spans(timings))
    spans = receiver.wait_for(TRACE_ID, 1 + num_children)
    roots = [s for s in spans if s.name == ROOT_SPAN]
    assert len(roots) == 1 and len(spans) == 1 + num_children, [s.name for s in spans]
    root = roots[0]
    assert root.parent_span_id == PARENT_SPAN_ID and root.kind == Span.SPAN_KIND_SERVER
    attributes = root.attributes
    assert attributes["gen_ai.request.id"] == answer["id"]
    assert attributes["gen_ai.response.model"] == MODEL
    assert attributes["gen_ai.usage.prompt_tokens"] == 3 == answer["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.completion_tokens"] == 4
    assert attributes["gen_ai.request.max_tokens"] == 4 and attributes["gen_ai.request.n"] == 1
    assert attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(timings.ttft_ms / 1000)
    assert attributes["gen_ai.latency.e2e"] == pytest.approx(timings.e2e_ms / 1000)
    assert attributes["pdserve.kv_transfer.bytes"] == timings.transfer_bytes > 0  # 1 prefill + 1 decode
    assert root.resource["service.name"] == "pdserve"
    # Disaggregated: the prompt was prefilled on the prefill worker and its KV pulled by the decode worker.
    check_stage_spans(spans, root, timings)
    assert {"prefill_queue", "transfer"} <= {s.name for s in spans}


def test_a_request_without_a_traceparent_starts_its_own_trace(traced: tuple[httpx.Client, OtlpReceiver]
                                                              ) -> None:
    client, receiver = traced
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/chat/completions", json=body) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines]
    request_id = chunks[0]["id"]
    timings = Timings(**next(chunk["timings"] for chunk in chunks if chunk.get("timings")))
    root = receiver.wait_for_root(request_id)
    assert root is not None and root.name == ROOT_SPAN and root.parent_span_id == ""
    assert root.trace_id != TRACE_ID
    spans = receiver.wait_for(root.trace_id, 1 + len(stage_spans(timings)))
    check_stage_spans(spans, root, timings)


def test_stages_of_a_prompt_prefilled_on_its_decode_worker_leave_out_the_others() -> None:
    local = Timings(gateway_queue_ms=0.0, prefill_queue_ms=0.0, prefill_ms=30.0, transfer_ms=0.0,
                    transfer_bytes=0, decode_queue_ms=0.0, decode_ms=50.0, ttft_ms=35.0, e2e_ms=90.0,
                    token_gaps_ms=[], to_prefill_ms=2.0, delivery_ms=1.0)
    assert [(s.name, s.start_ms, s.duration_ms) for s in stage_spans(local)] == [
        ("gateway_queue", 0.0, 0.0), ("to_prefill", 0.0, 2.0), ("prefill", 2.0, 30.0), ("decode", 32.0, 50.0),
        ("delivery", 82.0, 1.0)]


def test_stage_spans_end_with_the_request() -> None:
    # Stages measured on worker clocks may add up past the gateway's e2e (skew between hosts): cut there.
    skewed = Timings(gateway_queue_ms=5.0, prefill_queue_ms=0.0, prefill_ms=10.0, transfer_ms=4.0,
                     transfer_bytes=64, decode_queue_ms=0.0, decode_ms=10.0, ttft_ms=16.0, e2e_ms=20.0,
                     token_gaps_ms=[])
    spans = stage_spans(skewed)
    assert [(s.name, s.duration_ms) for s in spans] == [("gateway_queue", 5.0), ("prefill", 10.0),
                                                        ("transfer", 4.0), ("decode", 1.0)]
    assert spans[-1].start_ms + spans[-1].duration_ms == skewed.e2e_ms


def test_without_the_sdk_the_flag_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # import fails as if not installed
    with pytest.raises(ValidationError, match=INSTALL_HINT.replace("[", r"\[").replace("]", r"\]")):
        ServeConfig(otlp_traces_endpoint="http://127.0.0.1:4318/v1/traces")


@pytest.mark.parametrize(("prelude", "endpoint", "needle"), [
    ("sys.modules['opentelemetry.sdk.trace'] = None", "http://127.0.0.1:4318",
     "--otlp-traces-endpoint: traces need the OpenTelemetry SDK"),
    ("", "localhost:4318", "--otlp-traces-endpoint: 'localhost:4318' is not an http:// or https://"),
])
def test_the_cli_refuses_the_flag_naming_it(prelude: str, endpoint: str, needle: str) -> None:
    script = (f"import sys; {prelude}\nfrom pdserve.main import main\n"
              f"sys.exit(main(['serve', '--otlp-traces-endpoint', {endpoint!r}]))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    if prelude:
        assert INSTALL_HINT in result.stderr
