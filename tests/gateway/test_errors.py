"""The error handlers on their own (no Ray, no model): OpenAI's shape, and nothing internal in a body."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from ray.exceptions import RayError

from gateway.api.bad_request import BadRequest
from gateway.api.body_guard import BodyGuard
from gateway.api.errors import install_error_handlers
from gateway.api.protocol import CompletionRequest
from gateway.requests.admission import Overloaded

SECRET_DETAIL = "actor 5f1d9c0e2b7a died on node 10.1.2.3:6379 in namespace pdserve-ns; Traceback (most"


class ActorDied(RayError):
    def __str__(self) -> str:
        return SECRET_DETAIL


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyGuard, max_body_bytes=1000)

    @app.get("/ray")
    async def ray_failure() -> None:
        raise ActorDied()

    @app.get("/bug")
    async def bug() -> None:
        raise RuntimeError(SECRET_DETAIL)

    @app.get("/overloaded")
    async def overloaded() -> None:
        raise Overloaded("server busy", retry_after_s=7)

    @app.get("/bad")
    async def bad() -> None:
        raise BadRequest("no such model", status=404, param="model", code="model_not_found")

    @app.post("/echo")
    async def echo(body: CompletionRequest) -> dict[str, str]:
        return {"model": body.model}

    return TestClient(app, raise_server_exceptions=False)


def error_of(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    body = response.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "5f1d9c0e2b7a" not in response.text and "10.1.2.3" not in response.text  # type: ignore[attr-defined]
    assert "namespace" not in response.text and "Traceback" not in response.text  # type: ignore[attr-defined]
    return dict(body["error"])


def test_a_worker_failure_is_a_503_without_its_details(client: TestClient) -> None:
    error = error_of(client.get("/ray"), 503)
    assert error["type"] == "server_error" and "worker failed" in str(error["message"])
    assert "ActorDied" not in str(error["message"])


def test_a_bug_is_a_500_without_its_details(client: TestClient) -> None:
    error = error_of(client.get("/bug"), 500)
    assert error == {"message": "internal server error", "type": "server_error", "param": None, "code": None}


def test_overload_is_a_429_with_retry_after(client: TestClient) -> None:
    response = client.get("/overloaded")
    assert error_of(response, 429)["type"] == "rate_limit_error"
    assert response.headers["retry-after"] == "7"


def test_bad_request_keeps_status_param_and_code(client: TestClient) -> None:
    error = error_of(client.get("/bad"), 404)
    assert (error["type"], error["param"], error["code"]) == ("not_found_error", "model", "model_not_found")


def test_validation_errors_are_400s_naming_the_field(client: TestClient) -> None:
    error = error_of(client.post("/echo", json={"model": "m", "prompt": "a", "stop": ["ok", 5]}), 400)
    assert error["param"] == "stop[1]" and str(error["message"]).startswith("stop[1]: ")
    assert error_of(client.post("/echo", content=b"{", headers={"content-type": "application/json"}),
                    400)["message"].startswith("the request body is not valid JSON")  # type: ignore[union-attr]


def test_the_body_guard_refuses_big_and_non_json_bodies(client: TestClient) -> None:
    big = client.post("/echo", json={"model": "m", "prompt": "a" * 2000})
    assert "larger than the 1000 bytes" in str(error_of(big, 413)["message"])
    form_type = {"content-type": "application/x-www-form-urlencoded"}
    form = client.post("/echo", content=b"model=m", headers=form_type)
    assert "application/json" in str(error_of(form, 415)["message"])
    assert client.post("/echo", json={"model": "m", "prompt": "a"}).json() == {"model": "m"}
