"""Fuzzing a real server with schemathesis (tests/gateway/test_schema_fuzz.py, the /v1/responses suite): every
response documented, and every error body in OpenAI's shape with nothing of the process in it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.strategies import SearchStrategy

from tests.helpers.servers import API_KEY

# Nothing of the process may show in an error body.
LEAKS = ("Traceback", "File \"", "object at 0x", "ActorID", "actor_id", "namespace", "ray::", "127.0.0.1")


def check_error_body(response: httpx.Response | Any, sent: str = "") -> None:
    """`sent`: the request's body as text; what the client sent itself (a field named "127.0.0.1") may come
    back in the error that names it, and is no leak."""
    if response.status_code < 400:
        return
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    assert isinstance(body["error"]["type"], str) and body["error"]["type"], body
    assert not any(leak in response.text and leak not in sent for leak in LEAKS), response.text


def fuzz(strategy: SearchStrategy[Any], server: str, num_examples: int) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    checks = [schemathesis.checks.not_a_server_error, schemathesis.checks.status_code_conformance,
              schemathesis.checks.content_type_conformance, schemathesis.checks.response_headers_conformance,
              schemathesis.checks.response_schema_conformance, schemathesis.checks.negative_data_rejection]

    @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    @given(case=strategy)
    def one(case: Any) -> None:
        response = case.call(base_url=server, headers=auth, timeout=15)
        case.validate_response(response, checks=checks, headers=auth)
        check_error_body(response, json.dumps(case.body, default=str))

    one()
