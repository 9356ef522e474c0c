"""Keys over real HTTP: the API key guards every /v1 route, and /metrics when asked (--metrics-require-key:
this server; open by default, tests/gateway/test_metrics_scrape.py), the admin key guards /admin, and
neither opens the other's routes. A refusal is a 401 in OpenAI's shape that does not echo the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import Depends, FastAPI
from fastapi.testclient import TestClient

from gateway.api.auth import require_admin, require_api_key
from gateway.config import ServeConfig
from tests.helpers.servers import API_KEY, MODEL, serve_config, serving

ADMIN_KEY = "sk-admin-key"
WRONG_KEYS = {
    "missing": None,
    "wrong": "Bearer sk-nope",
    "admin key on an api route": f"Bearer {ADMIN_KEY}",
    "a prefix of the key": f"Bearer {API_KEY[:-1]}",
    "the key with a suffix": f"Bearer {API_KEY}x",
    "not bearer": f"Basic {API_KEY}",
    "no token": "Bearer",
}
API_ROUTES = [
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                      "max_tokens": 1}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
]


@pytest.fixture(scope="module")
def keyed_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    config = serve_config(tiny_chat_model_dir, admin_key=ADMIN_KEY, metrics_require_key=True)
    with serving(config) as (url, _):
        yield url


def call(server: str, method: str, path: str, body: object, authorization: str | None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    return httpx.request(method, f"{server}{path}", json=body, headers=headers, timeout=60)


def assert_refused(response: httpx.Response, secret: str | None) -> None:
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and "key" in error["message"]
    if secret:
        assert secret not in response.text  # the key sent is not echoed back


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
@pytest.mark.parametrize("case", list(WRONG_KEYS))
def test_api_routes_refuse_a_missing_or_wrong_key(keyed_server: str, method: str, path: str, body: object,
                                                  case: str) -> None:
    authorization = WRONG_KEYS[case]
    secret = authorization.partition(" ")[2] if authorization else None
    assert_refused(call(keyed_server, method, path, body, authorization), secret)


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
def test_api_routes_take_the_api_key(keyed_server: str, method: str, path: str, body: object) -> None:
    response = call(keyed_server, method, path, body, f"Bearer {API_KEY}")
    assert response.status_code == 200, response.text
    lowercase_scheme = call(keyed_server, method, path, body, f"bearer {API_KEY}")
    assert lowercase_scheme.status_code == 200


def test_the_key_is_checked_before_the_body(keyed_server: str) -> None:
    invalid = {"model": MODEL, "prompt": "x", "temperature": "hot"}
    assert_refused(call(keyed_server, "POST", "/v1/completions", invalid, "Bearer sk-nope"), "sk-nope")
    unknown_model = {"model": "gpt-9", "prompt": "x"}
    assert_refused(call(keyed_server, "POST", "/v1/completions", unknown_model, None), None)


@pytest.mark.parametrize("authorization", [None, "Bearer sk-nope", f"Bearer {API_KEY}", f"Basic {ADMIN_KEY}"])
def test_admin_routes_refuse_anything_but_the_admin_key(keyed_server: str, authorization: str | None) -> None:
    response = call(keyed_server, "GET", "/admin/pools", None, authorization)
    assert_refused(response, authorization.partition(" ")[2] if authorization else None)


def test_admin_routes_take_the_admin_key(keyed_server: str) -> None:
    response = call(keyed_server, "GET", "/admin/pools", None, f"Bearer {ADMIN_KEY}")
    assert response.status_code == 200 and response.json()["workers"]


def test_health_needs_no_key(keyed_server: str) -> None:
    assert call(keyed_server, "GET", "/health", None, None).status_code == 200


def test_openapi_declares_both_keys(keyed_server: str) -> None:
    openapi = call(keyed_server, "GET", "/openapi.json", None, None).json()
    schemes = openapi["components"]["securitySchemes"]
    assert [schemes[name]["scheme"].lower() for name in ("api_key", "admin_key")] == ["bearer", "bearer"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/v1/models", "get"),
                         ("/metrics", "get")]:
        assert openapi["paths"][path][method]["security"] == [{"api_key": []}], path
    assert openapi["paths"]["/admin/pools"]["get"]["security"] == [{"admin_key": []}]
    assert "security" not in openapi["paths"]["/health"]["get"]


def test_a_configured_key_ending_in_a_newline_is_the_key() -> None:
    """A key read from a file or a Kubernetes Secret often ends in a newline: stripped as the one sent is, it
    no longer locks everyone out. No server: the check alone, on a bare app."""
    app = FastAPI()
    app.state.config = ServeConfig(api_key=f"{API_KEY}\n", admin_key=f" {ADMIN_KEY}\n")

    @app.get("/v1/guarded", dependencies=[Depends(require_api_key)])
    @app.get("/admin/guarded", dependencies=[Depends(require_admin)])
    async def guarded() -> dict[str, str]:
        return {}

    with TestClient(app) as client:
        for path, key in (("/v1/guarded", API_KEY), ("/admin/guarded", ADMIN_KEY)):
            assert client.get(path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, path
            assert client.get(path, headers={"Authorization": f"Bearer {key}x"}).status_code == 401, path
            assert client.get(path).status_code == 401, path
