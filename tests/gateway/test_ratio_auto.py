"""`--ratio auto` on a real server (Ray actors, tiny Llama, nixl): two mixed workers become one prefill and
one decode worker when a long prompt arrives among running streams, and go back once prefill is calm; the
streams lose no token, the workers are the same processes throughout, every block comes back."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import ray
from fastapi import FastAPI

from gateway.config import ServeConfig
from gateway.fleet.adoption import worker_actor
from gateway.ratio.ladder import ControllerPolicy
from gateway.requests.router import LocalPrefillPolicy
from gateway.serve_settings import local_prefill_policy, planner_settings
from tests.helpers import actor_faults as faults
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.servers import MODEL, free_port, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow
VOCAB = 49152
FAST = ControllerPolicy(interval_s=0.2, min_dwell_s=0.5, calm_s=1.5, long_prompt_tokens=200)


@pytest.fixture(scope="module")
def auto_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[tuple[str, FastAPI]]:
    pytest.importorskip("nixl")
    config = ServeConfig(dtype="float32",
                         model=str(tiny_chat_model_dir), served_model_name=MODEL, backend="nixl", mixed=2,
                         ratio="auto", port=free_port(), kv_cache_mib=2, max_num_batched_tokens=64,
                         enable_prompt_tokens_details=True)  # the local-prefill reason in timings
    with serving(config) as (url, app):
        # The controller runs in the fleet actor: FAST applied as a supervisor rejoining it applies its own.
        app.state.control.rejoin(FAST, local_prefill_policy(config), True, planner_settings(config))
        yield url, app


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "never true"
        time.sleep(0.01)


def layout_of(client: httpx.Client) -> tuple[int, int, int]:
    pools = client.get("/admin/pools").json()
    return pools["prefill"], pools["decode"], pools["mixed"]


def wait_for_layout(client: httpx.Client, layout: tuple[int, int, int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while layout_of(client) != layout or client.get("/admin/pools").json()["change_in_progress"]:
        assert time.monotonic() < deadline, f"never reached {layout}: {client.get('/admin/pools').json()}"
        time.sleep(0.05)


def stream_tokens(url: str, prompt: list[int], max_tokens: int, out: list[list[int]]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    tokens: list[int] = []
    with httpx.Client(base_url=url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0]["token_ids"] or []
    out.append(tokens)


def prompt_tokens_prefilled(app: FastAPI) -> dict[str, float]:
    """Per worker: prompt tokens it prefilled (pdserve:prefix_cache_queries_total)."""
    samples = app.state.service.metrics.prefix_cache_queries.collect()[0].samples
    return {x.labels["worker"]: x.value for x in samples if x.name.endswith("_total")}


def test_auto_leaves_a_long_prompt_alone_on_a_worker_with_nothing_else_to_decode(
        auto_server: tuple[str, FastAPI]) -> None:
    """Light traffic: one stream decodes on one worker, the long prompt goes to the other, which stalls no
    one by prefilling it; both workers stay mixed (with the controller running all along)."""
    url, app = auto_server
    with httpx.Client(base_url=url, timeout=120) as client:
        assert layout_of(client) == (0, 0, 2) and client.get("/admin/pools").json()["auto"]
        num_decisions = len(client.get("/admin/pools").json()["ratio_decisions"])
        before = prompt_tokens_prefilled(app)
        streamed: list[list[int]] = []
        # 200 tokens: still decoding when the long prompt comes (60 took ~0.3 s on the test model).
        thread = threading.Thread(target=stream_tokens, args=(url, random_prompts([20], VOCAB, seed=53)[0],
                                                               200, streamed))
        thread.start()
        time.sleep(0.3)  # decoding
        [long_prompt] = random_prompts([300], VOCAB, seed=54)
        body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 6, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200
        thread.join(120)
        assert len(streamed) == 1 and len(streamed[0]) == 200
        # Prefilled by a mixed worker itself, and not the one decoding the stream.
        assert answer.json()["timings"]["prefill_on"] == "decode"
        assert answer.json()["timings"]["local_prefill_reason"] == "mixed worker"
        after = prompt_tokens_prefilled(app)
        grown = {w: after[w] - before.get(w, 0.0) for w in after}
        assert sorted(grown.values()) == [20.0, 300.0], grown
        assert layout_of(client) == (0, 0, 2) and client.get("/admin/pools").json()["auto"]
        assert len(client.get("/admin/pools").json()["ratio_decisions"]) == num_decisions


def test_auto_disaggregates_for_a_long_prompt_and_goes_back_when_calm(
        auto_server: tuple[str, FastAPI], tiny_chat_model_dir: Path) -> None:
    url, _ = auto_server
    with httpx.Client(base_url=url, timeout=120) as client:
        assert layout_of(client) == (0, 0, 2) and client.get("/admin/pools").json()["auto"] is True
        ids = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]]
        actors = [worker_actor(i) for i in ids]
        before = {i: ray.get(a.info.remote()) for i, a in zip(ids, actors, strict=True)}
        ray.get([a.__ray_call__.remote(faults.slow_steps, 0.01) for a in actors])

        stream_prompts = random_prompts([20, 24], VOCAB, seed=51)
        streamed: list[list[int]] = []
        threads = [threading.Thread(target=stream_tokens, args=(url, prompt, 120, streamed))
                   for prompt in stream_prompts]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # both streams decoding
        [long_prompt] = random_prompts([300], VOCAB, seed=52)
        body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 6, "temperature": 0,
                "return_token_ids": True}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        wait_for_layout(client, (1, 1, 0), timeout_s=10)
        for thread in threads:
            thread.join(120)
        wait_for_layout(client, (0, 0, 2), timeout_s=20)  # prefill calm: back to two mixed workers

        decisions = client.get("/admin/pools").json()["ratio_decisions"]
        assert [(d["from_level"], d["to_level"], d["reason"]) for d in decisions][:2] == [
            (0, 1, "long_prompt"), (1, 0, "prefill_idle")]
        metrics = client.get("/metrics").text
        assert ('pdserve:ratio_changes_total{from="mixed",model_name="tiny",reason="long_prompt",'
                'to="prefill"} 1.0') in metrics
        after = {i: ray.get(a.info.remote()) for i, a in zip(ids, actors, strict=True)}
        assert wait_until_no_blocks_used(client) == 0

    expected = hf_greedy(tiny_chat_model_dir, stream_prompts, 120, ignore_eos=True)
    assert sorted(streamed) == sorted(expected)
    assert answer.json()["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [long_prompt], 6)[0]
    # The same two processes throughout, the weights loaded once in each, and they did change role.
    assert {i: (x.actor_id, x.pid, x.num_model_loads) for i, x in after.items()} == {
        i: (x.actor_id, x.pid, 1) for i, x in before.items()}
    assert sum(x.num_role_changes for x in after.values()) >= 4


def test_auto_keeps_short_prompts_from_waiting_behind_long_ones(auto_server: tuple[str, FastAPI]) -> None:
    """While auto is on, a short prompt that arrives while the prefill pool is busy with a long one is
    prefilled on the decode worker; turned off, the operator's policy (here: always disaggregate) is back
    and the same short prompt waits for the prefill pool."""
    url, app = auto_server
    router = app.state.service.router
    with httpx.Client(base_url=url, timeout=120) as client:
        assert layout_of(client) == (0, 0, 2)
        ids = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]]
        actors = [worker_actor(i) for i in ids]
        ray.get([a.__ray_call__.remote(faults.slow_steps, 0.01) for a in actors])
        streamed: list[list[int]] = []
        threads = [threading.Thread(target=stream_tokens, args=(url, prompt, 120, streamed))
                   for prompt in random_prompts([20, 24], VOCAB, seed=55)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)  # both streams decoding
        [long_prompt] = random_prompts([300], VOCAB, seed=56)
        long_body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 2, "temperature": 0}
        assert client.post("/v1/completions", json=long_body).status_code == 200
        wait_for_layout(client, (1, 1, 0), timeout_s=10)  # disaggregated for the long prompt
        [prefill] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
                     if w["role"] == "prefill"]
        ray.get(worker_actor(prefill).__ray_call__.remote(faults.slow_steps, 0.3))

        def short_prompt_beside_a_long_one(seed: int) -> dict[str, object]:
            """The timings of a short prompt sent while the prefill pool prefills a long one."""
            busy: list[httpx.Response] = []
            prompt = random_prompts([300], VOCAB, seed=seed)[0]
            thread = threading.Thread(target=lambda: busy.append(client.post(
                "/v1/completions", json={**long_body, "prompt": prompt})))
            thread.start()
            deadline = time.monotonic() + 10
            while router.prefill_tokens[prefill] < 300:  # routed to the prefill pool, not prefilled yet
                assert time.monotonic() < deadline, "the long prompt never reached the prefill pool"
                time.sleep(0.01)
            short = {"model": MODEL, "prompt": random_prompts([20], VOCAB, seed=seed + 1)[0],
                     "max_tokens": 2, "temperature": 0}
            response = client.post("/v1/completions", json=short)
            assert response.status_code == 200, response.text
            thread.join(60)
            assert busy and busy[0].status_code == 200
            return dict(response.json()["timings"])

        try:
            timings = short_prompt_beside_a_long_one(57)
            assert timings["prefill_on"] == "decode"
            assert str(timings["local_prefill_reason"]).startswith("prefill queue")
            assert client.put("/admin/pools", json={"auto": False}).status_code == 200
            until(lambda: router.local_prefill == LocalPrefillPolicy())  # the fleet's next snapshot
            timings = short_prompt_beside_a_long_one(59)
            assert timings["prefill_on"] == "prefill"
        finally:
            assert client.put("/admin/pools", json={"auto": True}).status_code == 200
            ray.get([a.__ray_call__.remote(faults.heal) for a in actors])
            for thread in threads:
                thread.join(120)
        until(lambda: router.local_prefill.queue_rule_below_tokens == FAST.long_prompt_tokens)
        wait_for_layout(client, (0, 0, 2), timeout_s=30)  # calm again: back to two mixed workers
        assert wait_until_no_blocks_used(client) == 0
