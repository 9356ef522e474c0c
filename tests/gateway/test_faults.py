"""Fault injection on a real server (1 prefill + 2 decode Ray actors, tiny Llama): after every fault each
request ended (its tokens, or a clear error) within its deadline, no KV block is left in use, the failed
worker was replaced, and the server still serves.

Faults reach the real actors through Ray's `__ray_call__` (a function run on the actor instance): a step
made slow or made to raise, a pull made to fail or to hang; killed actors are killed with `ray.kill`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from fastapi import FastAPI

from gateway.config import ServeConfig
from gateway.fleet.adoption import worker_actor
from gateway.requests.deadlines import DeadlinePolicy
from gateway.requests.router import LocalPrefillPolicy
from kv_transfer import TransferConfig
from tests.helpers import actor_faults as faults
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.servers import MODEL, free_port, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow
VOCAB = 49152




@pytest.fixture(scope="module")
def fault_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[tuple[str, FastAPI]]:
    config = ServeConfig(
        dtype="float32", model=str(tiny_chat_model_dir), served_model_name=MODEL, prefill=1, decode=2,
        port=free_port(),
        kv_cache_mib=2,  # 64 blocks of 16 tokens per worker
        max_num_batched_tokens=32,  # long prompts take many prefill steps: time to hit them mid-prefill
        max_waiting=8, queue_timeout_s=30,
    )
    with serving(config) as running:
        yield running


@pytest.fixture
def client(fault_server: tuple[str, FastAPI]) -> Iterator[httpx.Client]:
    """A client; after the test every worker is healed, the pools are whole again and nothing is in use."""
    url, app = fault_server
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c
        for worker in active_workers(c):
            with_actor(worker, faults.heal)
        wait_for_health(c, "ok", timeout_s=90)
        assert wait_until_no_blocks_used(c, timeout_s=20) == 0
        assert app.state.service.admission.reserved_tokens == 0


def active_workers(client: httpx.Client, kind: str | None = None) -> list[str]:
    workers = client.get("/admin/pools").json()["workers"]
    return [w["worker_id"] for w in workers if w["state"] == "active" and kind in (None, w["role"])]


def with_actor(worker_id: str, fn: Callable[..., None], *args: object) -> None:
    actor = worker_actor(worker_id)
    ray.get(actor.__ray_call__.remote(fn, *args))


def wait_for_health(client: httpx.Client, status: str, timeout_s: float) -> dict[str, Any]:
    body: dict[str, Any] = {}
    for _ in range(int(timeout_s / 0.1)):
        body = client.get("/health").json()
        if body["status"] == status:
            return body
        time.sleep(0.1)
    raise AssertionError(f"/health never said {status!r}; last: {body}")


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0,
             state: Callable[[], object] = str) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition never held; {state()}")


def worker_load(client: httpx.Client, worker_id: str) -> dict[str, Any]:
    for worker in client.get("/admin/pools").json()["workers"]:
        if worker["worker_id"] == worker_id:
            return dict(worker)
    return {}


def complete(client: httpx.Client, prompt: list[int], max_tokens: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True}
    return client.post("/v1/completions", json=body)


def in_thread(fn: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    """Start fn on a thread; the returned function joins it and gives its result."""
    result: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()

    def join() -> httpx.Response:
        thread.join(120)
        assert result, "the request never ended"
        return result[0]

    return join


def stream_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line == "data: [DONE]":
            yield {"done": True}
        elif line.startswith("data: "):
            yield json.loads(line[6:])


def test_prefill_worker_killed_mid_prefill_is_retried_on_its_replacement(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    [prefill] = active_workers(client, "prefill")
    with_actor(prefill, faults.slow_steps, 0.05)
    prompt = random_prompts([400], VOCAB, seed=11)[0]  # 13 chunks of 32 tokens: ~0.7 s of prefill
    join = in_thread(lambda: complete(client, prompt, 8))
    wait_for(lambda: worker_load(client, prefill).get("running_requests", 0) > 0)
    ray.kill(worker_actor(prefill))
    assert wait_for_health(client, "degraded", timeout_s=10)["target_workers"]["prefill"] == 1
    response = join()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 8)[0]
    wait_for_health(client, "ok", timeout_s=60)
    assert prefill not in active_workers(client, "prefill")


def test_decode_worker_killed_mid_stream_migrates_without_losing_a_token(
        client: httpx.Client, fault_server: tuple[str, FastAPI], tiny_chat_model_dir: Path) -> None:
    migrations = fault_server[1].state.service.metrics.migrations
    num_migrations = migrations._value.get()
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.slow_steps, 0.03)
    prompt = random_prompts([30], VOCAB, seed=12)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "return_token_ids": True,
            "stream": True}
    token_ids: list[int] = []
    events = []
    killed = ""
    with client.stream("POST", "/v1/completions", json=body) as response:
        for event in stream_events(response):
            events.append(event)
            if event.get("choices"):
                token_ids.extend(event["choices"][0].get("token_ids") or [])
            if len(token_ids) >= 5 and not killed:
                [killed] = [w for w in active_workers(client, "decode")
                            if worker_load(client, w)["running_requests"] > 0]
                ray.kill(worker_actor(killed))
    assert not [e for e in events if "error" in e]
    assert events[-1] == {"done": True}
    assert killed, "the stream ended before a worker could be killed"
    assert token_ids == hf_greedy(tiny_chat_model_dir, [prompt], 40)[0]
    [timings] = [e["timings"] for e in events if e.get("timings")]
    assert timings["num_moves"] == 1  # one worker left behind, and counted:
    assert migrations._value.get() == num_migrations + 1
    assert killed not in active_workers(client)


def test_decode_step_loop_that_raises_fails_over_every_request(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    broken = active_workers(client, "decode")[0]
    with_actor(broken, faults.raise_in_next_step)
    prompts = random_prompts([12, 20, 28, 36], VOCAB, seed=13)
    joins = [in_thread(lambda p=p: complete(client, p, 10)) for p in prompts]  # type: ignore[misc]
    responses = [join() for join in joins]
    expected = hf_greedy(tiny_chat_model_dir, prompts, 10)
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == expected
    wait_for_health(client, "ok", timeout_s=60)
    assert broken not in active_workers(client)


def test_a_query_of_death_costs_at_most_one_more_worker_and_other_streams_survive(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    decodes = active_workers(client, "decode")
    for decode in decodes:
        with_actor(decode, faults.slow_steps, 0.03)
        with_actor(decode, faults.raise_in_steps_with_seed, 4242)  # on every decode worker there is
    prompt = random_prompts([30], VOCAB, seed=24)[0]
    other = in_thread(lambda: complete(client, prompt, 60))
    wait_for(lambda: any(worker_load(client, w)["running_requests"] for w in decodes))
    # Picked for the idle decode worker: it breaks that one; moved to the other, it breaks it too (taking
    # the other stream down with it); then it ends with an error instead of moving on to a third.
    deadly = {"model": MODEL, "prompt": random_prompts([20], VOCAB, seed=25)[0], "max_tokens": 20,
              "temperature": 0, "seed": 4242}
    response = client.post("/v1/completions", json=deadly)
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "worker_failed"
    assert "failed on 2 decode workers" in response.json()["error"]["message"]
    survivor = other()
    assert survivor.status_code == 200, survivor.text
    assert survivor.json()["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 60)[0]
    assert survivor.json()["timings"]["num_moves"] == 1  # moved once, to a replacement
    wait_for_health(client, "ok", timeout_s=90)
    assert not set(decodes) & set(active_workers(client))


def test_requests_whose_streams_the_fleet_closed_start_again_as_new_attempts(
        fault_server: tuple[str, FastAPI], client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    """Issue 48, defect 2 (review P2): the fleet closes this gateway's channels on every worker (as it does
    for a frontend it takes for dead), while one request decodes and another is mid-prefill. The workers
    abort what the channels carried and remember those ids; the gateway submits each request again as a new
    attempt (an id of its own), never refused as "aborted before it arrived": both end with the reference
    tokens, and no worker is replaced."""
    _, app = fault_server
    gateway_id = app.state.service.fleet.frontend_id  # its output channels' prefix on every worker
    [prefill] = active_workers(client, "prefill")
    decodes = active_workers(client, "decode")
    for decode in decodes:
        with_actor(decode, faults.slow_steps, 0.02)
    prompts = random_prompts([30, 40], VOCAB, seed=31)
    decoding = in_thread(lambda: complete(client, prompts[0], 40))
    wait_for(lambda: any(worker_load(client, w)["running_requests"] for w in decodes))
    with_actor(prefill, faults.hold_steps)  # the next prompt stays mid-prefill
    prefilling = in_thread(lambda: complete(client, prompts[1], 12))
    wait_for(lambda: worker_load(client, prefill)["requests"] == 1)
    for worker in [prefill, *decodes]:
        ray.get(worker_actor(worker).close_channels.remote(gateway_id))
    with_actor(prefill, faults.release_steps)
    responses = [decoding(), prefilling()]
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    expected = [hf_greedy(tiny_chat_model_dir, [prompts[0]], 40)[0],
                hf_greedy(tiny_chat_model_dir, [prompts[1]], 12)[0]]
    assert [r.json()["choices"][0]["token_ids"] for r in responses] == expected
    assert sorted(active_workers(client)) == sorted([prefill, *decodes])  # nobody replaced


def test_evacuation_hands_an_unpulled_handoff_on_to_be_pulled_not_recomputed(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    decodes = active_workers(client, "decode")
    streams = random_prompts([16, 18], VOCAB, seed=26)
    # A stream on each decode worker, each held in a step: what reaches a worker now waits in its inbox.
    for decode in decodes:
        with_actor(decode, faults.hold_steps)
    joins = []
    for num_started, stream in enumerate(streams, 1):  # one after the other: each to the idle worker
        joins.append(in_thread(lambda p=stream: complete(client, p, 8)))  # type: ignore[misc]
        wait_for(lambda n=num_started: sum(worker_load(client, w)["requests"] for w in decodes) == n,
                 state=lambda: client.get("/admin/pools").json())
    assert all(worker_load(client, w)["requests"] == 1 for w in decodes)
    prompt = random_prompts([50], VOCAB, seed=27)[0]
    handed_off = in_thread(lambda: complete(client, prompt, 8))
    wait_for(lambda: sum(worker_load(client, w)["requests"] for w in decodes) == 3,
             state=lambda: client.get("/admin/pools").json())  # its handoff reached a decode worker
    [holder] = [w for w in decodes if worker_load(client, w)["requests"] == 2]
    evacuate = worker_actor(holder).evacuate.remote()  # queued after the handoff
    ray.get(evacuate)
    for decode in decodes:
        with_actor(decode, faults.release_steps)
    response = handed_off()
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 8)[0]
    assert data["timings"]["num_moves"] == 1
    assert data["timings"]["transfer_bytes"] > 0  # pulled from the prefill worker by the next decode worker
    assert data["timings"]["prefill_on"] == "prefill"
    expected = hf_greedy(tiny_chat_model_dir, streams, 8)
    assert [join().json()["choices"][0]["token_ids"] for join in joins] == expected


def test_health_checks_cost_the_workers_nothing(client: httpx.Client) -> None:
    actor = worker_actor(active_workers(client, 'decode')[0])
    ray.get(actor.__ray_call__.remote(faults.count_loads))
    for _ in range(40):
        assert client.get("/health").json()["status"] == "ok"
    # Only the pool watch's reports (one a second), not one per /health call.
    assert ray.get(actor.__ray_call__.remote(faults.num_loads)) < 20


def test_prefill_step_loop_that_raises_is_retried(client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    [prefill] = active_workers(client, "prefill")
    with_actor(prefill, faults.raise_in_next_step)
    prompt = random_prompts([24], VOCAB, seed=14)[0]
    response = complete(client, prompt, 6)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 6)[0]
    wait_for_health(client, "ok", timeout_s=60)
    assert prefill not in active_workers(client)


def test_dropped_transfer_recomputes_and_frees_the_prefill_blocks_at_once(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.fail_pulls)
    prompt = random_prompts([50], VOCAB, seed=15)[0]
    response = complete(client, prompt, 6)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 6)[0]
    assert data["timings"]["transfer_bytes"] == 0  # recomputed on the decode worker
    # The decode side released the prefill blocks explicitly: well before the 30 s lease would have.
    assert wait_until_no_blocks_used(client, timeout_s=3) == 0


def test_client_gone_while_prefilling_frees_everything(client: httpx.Client) -> None:
    [prefill] = active_workers(client, "prefill")
    with_actor(prefill, faults.slow_steps, 0.05)
    body = {"model": MODEL, "prompt": random_prompts([400], VOCAB, seed=16)[0], "max_tokens": 8,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body):
        wait_for(lambda: worker_load(client, prefill).get("running_requests", 0) > 0)
    wait_for(lambda: worker_load(client, prefill)["queued_prompt_tokens"] == 0, timeout_s=5)
    assert wait_until_no_blocks_used(client, timeout_s=5) == 0


def test_client_gone_while_transferring_frees_everything(client: httpx.Client) -> None:
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.stall_pulls)
    body = {"model": MODEL, "prompt": random_prompts([50], VOCAB, seed=17)[0], "max_tokens": 8,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        events = stream_events(response)  # held: closing it would close the connection now
        while not next(events).get("choices"):
            pass  # the first token came from the prefill worker; the pull now hangs
        decodes = active_workers(client, "decode")
        wait_for(lambda: any(worker_load(client, w)["transferring"] for w in decodes),
                 state=lambda: client.get("/admin/pools").json())
    # The aborted pull ends at its transfer deadline (10 s); then both sides free their blocks.
    assert wait_until_no_blocks_used(client, timeout_s=20) == 0


def test_client_gone_right_after_the_first_token_frees_the_prefill_kv_at_once(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": random_prompts([50], VOCAB, seed=22)[0], "max_tokens": 8,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for event in stream_events(response):
            if event.get("choices"):
                break  # and the connection closes with the events' iterator
    # Whether the decode stage had the handle yet or not, nothing waits for the 30 s lease: the gateway
    # withdraws it, or the decode worker aborts (and releases) what it holds.
    assert wait_until_no_blocks_used(client, timeout_s=3) == 0


def test_lease_ends_unpulled_kv_when_every_release_is_lost(client: httpx.Client) -> None:
    [prefill] = active_workers(client, "prefill")
    with_actor(prefill, faults.lose_releases_and_shorten_leases)
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.fail_pulls)  # nobody will pull: only the (1 s) lease can free the blocks
    body = {"model": MODEL, "prompt": random_prompts([50], VOCAB, seed=23)[0], "max_tokens": 8,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for event in stream_events(response):
            if event.get("choices"):
                break
    assert wait_until_no_blocks_used(client, timeout_s=10) == 0
    records = ray.get(worker_actor(prefill).transfer_records.remote())
    assert records[-1].outcome == "EXPIRED"
    with_actor(prefill, faults.heal)  # (the fixture heals too, whether or not the test got here)
    lease_s = ray.get(worker_actor(prefill).__ray_call__.remote(_lease_s))
    assert lease_s == TransferConfig().lease_s


def _lease_s(actor: Any) -> float:
    return float(actor.worker.sender.config.lease_s)


def test_a_pull_that_hangs_past_its_timeout_is_recomputed_and_frees_the_prefill_blocks(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.stall_pulls)  # posted, never heard of again: only its deadline ends it
    prompt = random_prompts([50], VOCAB, seed=28)[0]
    response = complete(client, prompt, 6)  # the client keeps waiting
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 6)[0]
    assert data["timings"]["transfer_bytes"] == 0  # recomputed on the decode worker
    assert wait_until_no_blocks_used(client, timeout_s=5) == 0


def test_client_gone_while_decoding_frees_everything(client: httpx.Client) -> None:
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.slow_steps, 0.03)
    body = {"model": MODEL, "prompt": random_prompts([40], VOCAB, seed=18)[0], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        num_events = 0
        for event in stream_events(response):
            num_events += bool(event.get("choices"))
            if num_events == 4:
                break
    assert wait_until_no_blocks_used(client, timeout_s=5) == 0


def test_client_gone_while_queued_for_admission_leaves_the_line(
        client: httpx.Client, fault_server: tuple[str, FastAPI]) -> None:
    admission = fault_server[1].state.service.admission
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.slow_steps, 0.02)
    big = {"model": MODEL, "prompt": random_prompts([30], VOCAB, seed=19)[0], "max_tokens": 900,
           "ignore_eos": True, "stream": True}
    url = fault_server[0]
    with client.stream("POST", "/v1/completions", json=big), \
            client.stream("POST", "/v1/completions", json=big):
        wait_for(lambda: admission.reserved_tokens == 2 * 930)
        # The third waits in line for capacity; its client gives up after 2 s and closes the connection.
        impatient = in_thread(lambda: _post_expecting_timeout(url, big, read_timeout_s=2.0))
        wait_for(lambda: admission.num_waiting == 1)
        impatient()
        wait_for(lambda: admission.num_waiting == 0, timeout_s=5)
        assert admission.reserved_tokens == 2 * 930
    wait_for(lambda: admission.reserved_tokens == 0)


def _post_expecting_timeout(url: str, body: dict[str, Any], read_timeout_s: float) -> httpx.Response:
    try:
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=read_timeout_s))
    except httpx.ReadTimeout:
        return httpx.Response(499)
    raise AssertionError("the request was answered while it should have been waiting")


def test_burst_of_ten_times_capacity_gets_429s_and_the_server_recovers(
        client: httpx.Client, fault_server: tuple[str, FastAPI], tiny_chat_model_dir: Path) -> None:
    url, app = fault_server
    per_request = 30 + 60
    num_requests = 10 * app.state.service.admission.capacity_tokens // per_request

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as session:
            prompts = random_prompts([30] * num_requests, VOCAB, seed=20)
            return list(await asyncio.gather(*(session.post("/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 60, "ignore_eos": True}) for p in prompts)))

    responses = asyncio.run(burst())
    statuses = {r.status_code for r in responses}
    assert statuses <= {200, 429} and 429 in statuses and 200 in statuses
    for response in responses:
        if response.status_code == 429:
            assert int(response.headers["retry-after"]) >= 1
            assert response.json()["error"]["type"] == "rate_limit_error"
        else:
            assert response.json()["usage"]["completion_tokens"] == 60
    assert wait_until_no_blocks_used(client, timeout_s=10) == 0
    prompt = random_prompts([16], VOCAB, seed=21)[0]
    after = complete(client, prompt, 5)
    assert after.json()["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 5)[0]


def test_request_past_its_deadline_ends_with_a_clear_error(
        client: httpx.Client, fault_server: tuple[str, FastAPI]) -> None:
    service = fault_server[1].state.service
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.slow_steps, 0.05)
    service.deadline_policy = DeadlinePolicy(slack_s=0.5, prefill_s_per_token=0.0, decode_s_per_token=0.0)
    try:
        body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 100, "ignore_eos": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "deadline_exceeded"
        assert "deadline" in response.json()["error"]["message"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            events = list(stream_events(streamed))
        assert events[-2]["error"]["code"] == "deadline_exceeded" and events[-1] == {"done": True}
    finally:
        service.deadline_policy = DeadlinePolicy()
    assert wait_until_no_blocks_used(client, timeout_s=5) == 0


def test_a_prompt_prefilled_on_its_decode_worker_keeps_the_prefill_deadline(
        client: httpx.Client, fault_server: tuple[str, FastAPI]) -> None:
    service = fault_server[1].state.service
    for decode in active_workers(client, "decode"):
        with_actor(decode, faults.slow_steps, 0.3)
    operators = service.router.local_prefill
    service.router.local_prefill = LocalPrefillPolicy(max_uncached_tokens=1000)  # every prompt prefills there
    # The first token is due 0.5 s after admission (5 chunks of 32 tokens take longer), the last much later.
    service.deadline_policy = DeadlinePolicy(slack_s=0.5, prefill_s_per_token=0.0, decode_s_per_token=100.0)
    try:
        body = {"model": MODEL, "prompt": random_prompts([150], VOCAB, seed=29)[0], "max_tokens": 4}
        response = client.post("/v1/completions", json=body)
    finally:
        service.deadline_policy = DeadlinePolicy()
        service.router.local_prefill = operators
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "deadline_exceeded"
    assert "prefill stage" in response.json()["error"]["message"]
