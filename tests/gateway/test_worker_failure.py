"""The only decode worker dies (1 prefill + 1 decode): the next request waits for the replacement the gateway
starts by itself and is served; /health says degraded meanwhile (states and counts only), then ok. On the
shared default server (tests/gateway/conftest.py), which it leaves serving with the replacement."""

from __future__ import annotations

import time

import httpx
import ray

from gateway.fleet.adoption import worker_actor
from tests.helpers.servers import MODEL, wait_until_no_blocks_used


def test_dead_only_decode_worker_is_replaced_and_requests_wait_for_it(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0, "return_token_ids": True}
    before = client.post("/v1/completions", json=body)
    assert before.status_code == 200
    [decode] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"] if w["role"] == "decode"]
    ray.kill(worker_actor(decode))

    # /health reads the pool watch's loads (no RPC per call): the death shows within its interval (1 s).
    for _ in range(100):
        health = client.get("/health")
        if health.json()["status"] != "ok":
            break
        time.sleep(0.1)
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert health.json()["target_workers"]["decode"] == 1
    for forbidden in ("Traceback", "Error", "pdserve-", "actor", "127.0.0.1", "namespace"):
        assert forbidden not in health.text

    after = client.post("/v1/completions", json=body)
    assert after.status_code == 200, after.text
    assert after.json()["choices"][0]["token_ids"] == before.json()["choices"][0]["token_ids"]
    for _ in range(300):
        if client.get("/health").json()["status"] == "ok":
            break
        time.sleep(0.1)
    assert client.get("/health").json() == {
        "status": "ok", "active_workers": {"prefill": 1, "decode": 1, "mixed": 0},
        "target_workers": {"prefill": 1, "decode": 1, "mixed": 0}, "replacing": 0, "pending": 0,
    }
    workers = client.get("/admin/pools").json()["workers"]
    assert decode not in [w["worker_id"] for w in workers]
    assert wait_until_no_blocks_used(client) == 0
