"""A decode worker that dies: requests get a 503 with a message, /health says unhealthy."""

from __future__ import annotations

import httpx
import ray

from tests.gateway.conftest import MODEL


def test_dead_decode_worker_gives_503_not_500(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    assert client.post("/v1/completions", json=body).status_code == 200
    ray.kill(ray.get_actor("pdserve-decode-1"))
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 503
    assert "worker failed" in response.json()["error"]["message"]
    assert client.get("/health").status_code == 503
