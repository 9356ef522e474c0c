"""Schemathesis fuzzes the server's own OpenAPI description against the real server.

Positive cases (valid by the description) have the model pinned to the served one and max_tokens bounded, so
they get past the model check to the validation behind it and generate cheaply; negative cases (each breaks
the description somewhere) have only the model pinned. For every response: no 5xx, a documented status, a
body and headers as documented, and every non-2xx body in OpenAI's error shape with nothing internal in it.
"""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest

from tests.helpers.servers import MODEL, SHARED_DEFAULT_MAX_TOKENS, wait_until_no_blocks_used

schemathesis = pytest.importorskip("schemathesis")
from tests.helpers.schema_fuzz import fuzz  # noqa: E402  (needs schemathesis)

# Generation stays cheap: every valid request makes at most this many tokens. The shared default server
# (tests/gateway/conftest.py) gives chat requests that name no max_tokens as many (negative cases that the
# server rightly accepts, such as one with an empty-named extra field, are served).
MAX_FUZZ_TOKENS = SHARED_DEFAULT_MAX_TOKENS
GENERATE_ROUTES = ("/v1/completions", "/v1/chat/completions")
NUM_EXAMPLES = {"positive": 100, "negative": 100}  # per route; the module takes well under 2 minutes


def pin(openapi: dict[str, Any], bound_max_tokens: bool) -> dict[str, Any]:
    """The description with `model` fixed to the served name and, for positive cases, max_tokens bounded."""
    pinned = copy.deepcopy(openapi)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        request = pinned["components"]["schemas"][name]
        request["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        if name == "ChatCompletionRequest":
            # Past maxItems, the fuzzer's messages outgrow the body limit: a 413, which schemathesis does not
            # count as rejecting the data. The message cap has its own test (test_hostile_inputs).
            request["properties"]["messages"].pop("maxItems", None)
        if bound_max_tokens:
            bounded = {"type": "integer", "minimum": 1, "maximum": MAX_FUZZ_TOKENS}
            request["properties"]["max_tokens"] = bounded
            request["required"] = [*request["required"], "max_tokens"]
            if "max_completion_tokens" in request["properties"]:
                request["properties"]["max_completion_tokens"] = bounded
    return pinned


@pytest.fixture(scope="module")
def openapi(server: str) -> dict[str, Any]:
    response = httpx.get(f"{server}/openapi.json")
    assert response.status_code == 200
    return dict(response.json())


def test_the_description_lists_the_errors_the_server_gives(openapi: dict[str, Any]) -> None:
    paths = openapi["paths"]
    for route in GENERATE_ROUTES:
        responses = paths[route]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "415", "429", "503"}, route
        for status in ("400", "401", "404", "413", "415", "429", "503"):
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (route, status)
        assert responses["429"]["headers"]["Retry-After"]["required"] is True
        assert "text/event-stream" in responses["200"]["content"]
    assert set(paths["/v1/models"]["get"]["responses"]) == {"200", "401"}
    assert set(paths["/metrics"]["get"]["responses"]) == {"200"}  # open unless --metrics-require-key
    assert set(paths["/admin/pools"]["get"]["responses"]) == {"200", "401", "403"}
    assert set(paths["/admin/pools"]["put"]["responses"]) == {"200", "400", "401", "403", "409"}
    assert "422" not in str(openapi) and "HTTPValidationError" not in openapi["components"]["schemas"]
    error_body = openapi["components"]["schemas"]["ErrorBody"]
    assert set(error_body["properties"]) == {"message", "type", "param", "code"}
    assert {"api_key", "admin_key"} <= set(openapi["components"]["securitySchemes"])


@pytest.mark.parametrize("route", GENERATE_ROUTES)
@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_get_documented_answers(server: str, client: httpx.Client, openapi: dict[str, Any],
                                                route: str, mode: str) -> None:
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(pin(openapi, bound_max_tokens=mode == "positive"))
    operation = schema[route]["POST"]
    generation_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    fuzz(operation.as_strategy(generation_mode=generation_mode), server, NUM_EXAMPLES[mode])
    # Nothing it sent broke a worker or leaked a block.
    normal = client.post("/v1/completions", json={"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert normal.status_code == 200, normal.text
    assert wait_until_no_blocks_used(client) == 0


def test_fuzzed_get_routes(server: str, openapi: dict[str, Any]) -> None:
    schema = schemathesis.openapi.from_dict(openapi)
    for route in ("/v1/models", "/metrics", "/admin/pools", "/health"):
        fuzz(schema[route]["GET"].as_strategy(), server, 2)
