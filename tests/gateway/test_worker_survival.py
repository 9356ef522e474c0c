"""Workers that must not take their fleet down, or stay down.

A grammar that does not compile on a worker (review N7) refuses that request alone (400), compiled off the
step loop; the worker serves on. A decode worker whose step hangs (review N3): no error, no dead actor, only
a step that never returns: the fleet's watchdog takes a step far past the worker's own (step_watchdog_s, and
10× its longest finished step) for hung: the worker is replaced, and the request it held moves on and ends
whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from gateway.fleet.adoption import worker_actor
from tests.helpers import actor_faults as faults
from tests.helpers.servers import API_KEY, MODEL, serve_config, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow

BODY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
        "return_token_ids": True}


@pytest.fixture(scope="module")
def client(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[httpx.Client]:
    with serving(serve_config(tiny_chat_model_dir, step_watchdog_s=2.0)) as (url, _), httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def decode_worker(client: httpx.Client) -> str:
    [worker] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"] if w["role"] == "decode"]
    return worker


def test_a_grammar_that_does_not_compile_refuses_its_request_alone(client: httpx.Client) -> None:
    pids = {w["worker_id"]: w["pid"] for w in client.get("/admin/pools").json()["workers"]}
    for worker_id in pids:
        ray.get(worker_actor(worker_id).__ray_call__.remote(faults.refuse_grammars))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    refused = client.post("/v1/completions", json={
        **BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
    assert refused.status_code == 400, refused.text
    assert "grammar" in refused.json()["error"]["message"]
    assert client.post("/v1/completions", json=BODY).status_code == 200  # the worker serves on
    assert {w["worker_id"]: w["pid"] for w in client.get("/admin/pools").json()["workers"]} == pids


def test_a_hung_decode_step_gets_the_worker_replaced_and_the_request_finishes(client: httpx.Client) -> None:
    expected = client.post("/v1/completions", json=BODY).json()["choices"][0]["token_ids"]
    hung = decode_worker(client)
    # Its next step waits at a gate for 60 s: far past the watchdog's bound, and no error anywhere.
    ray.get(worker_actor(hung).__ray_call__.remote(faults.hold_steps))
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(client.post("/v1/completions", json=BODY)))
    request.start()
    request.join(180)
    [answer] = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == expected
    assert hung not in [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]]
    deadline = time.monotonic() + 120
    while client.get("/health").json()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get("/health").json()["status"] == "ok"
    assert wait_until_no_blocks_used(client) == 0
