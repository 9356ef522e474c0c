"""The gateway over real HTTP: OpenAI-compatible completions and chat, streaming and not, timings, metrics."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.adoption import worker_actor
from llm_engine.model_files import load_tokenizer
from tests.helpers.reference import hf_greedy
from tests.helpers.servers import API_KEY, MODEL, burst, wait_until_no_blocks_used

STAGES = ("gateway_queue_ms", "prefill_queue_ms", "prefill_ms", "transfer_ms", "decode_queue_ms", "decode_ms")
HOPS = ("to_prefill_ms", "handoff_ms", "delivery_ms")


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[6:]))
    return events


def test_completion_greedy_matches_transformers(client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    prompt = "The quick brown fox jumps over the lazy dog because"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    expected = hf_greedy(tiny_chat_model_dir, [tokenizer.encode(prompt)], 12)[0]
    choice = data["choices"][0]
    assert choice["token_ids"] == expected
    assert choice["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert data["usage"] == {"prompt_tokens": len(tokenizer.encode(prompt)), "completion_tokens": 12,
                             "total_tokens": len(tokenizer.encode(prompt)) + 12}
    timings = data["timings"]
    assert sum(timings[s] for s in STAGES) <= timings["e2e_ms"] + 1.0
    # With the hops between processes, the stages account for the whole request.
    assert sum(timings[s] for s in (*STAGES, *HOPS)) == pytest.approx(timings["e2e_ms"], abs=2.0)
    assert timings["ttft_ms"] <= timings["e2e_ms"] and len(timings["token_gaps_ms"]) == 11
    assert timings["transfer_bytes"] > 0


def test_streaming_completion_equals_the_whole_one(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9, 10], "max_tokens": 10, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()
    stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=stream_body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == whole["choices"][0]["text"]
    final = [e for e in events if e["choices"] and e["choices"][0].get("finish_reason")]
    assert len(final) == 1 and "timings" in final[0]
    assert events[-1]["usage"]["completion_tokens"] == 10 and events[-1]["choices"] == []


def test_chat_with_the_openai_sdk(server: str, tiny_chat_model_dir: Path) -> None:
    sdk = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": "Say something."}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(encoded["input_ids"])
    expected = hf_greedy(tiny_chat_model_dir, [prompt], 8)[0]
    assert whole.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                              stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    completion = sdk.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.usage is not None and completion.usage.completion_tokens == 4
    assert [m.id for m in sdk.models.list().data] == [MODEL]


def test_stop_string_cuts_the_text_and_frees_blocks(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [11, 12, 13], "max_tokens": 20, "temperature": 0}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop
    cut = client.post("/v1/completions", json={**body, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]
    assert wait_until_no_blocks_used(client) == 0


def metric_samples(client: httpx.Client) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def test_metrics_count_what_was_served(client: httpx.Client) -> None:
    before = metric_samples(client)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    greedy = {"model": MODEL, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    bodies = [{**greedy, "prompt": p} for p in prompts]
    answers = [client.post("/v1/completions", json=body).json() for body in bodies]
    assert [a["usage"]["completion_tokens"] for a in answers] == [4, 4]
    assert wait_until_no_blocks_used(client) == 0
    after = metric_samples(client)

    def grew(name: str, **labels: str) -> float:
        key = (name, frozenset({"model_name": MODEL, **labels}.items()))
        return after[key] - before.get(key, 0.0)

    assert grew("pdserve:request_success_total", finished_reason="length") == 2
    assert grew("pdserve:prompt_tokens_total") == 3 + 5
    assert grew("pdserve:generation_tokens_total") == 4 + 4
    for histogram in ("pdserve:time_to_first_token_seconds_count",
                      "pdserve:e2e_request_latency_seconds_count",
                      "pdserve:request_time_per_output_token_seconds_count"):
        assert grew(histogram) == 2, histogram
    for stage in ("prefill", "transfer", "decode"):
        assert grew("pdserve:request_stage_seconds_count", stage=stage) == 2, stage
    # at least one gap per request (steps may coalesce)
    assert grew("pdserve:inter_token_latency_seconds_count") >= 2
    assert grew("pdserve:kv_transfer_bytes_total") > 0
    # The gauges, read after the requests finished: nothing runs, no block is in use, nothing waits.
    workers = client.get("/admin/pools").json()["workers"]
    for worker in workers:
        labels = {"model_name": MODEL, "worker": worker["worker_id"], "role": worker["role"]}
        assert after[("pdserve:num_requests_running", frozenset(labels.items()))] == 0
        assert after[("pdserve:kv_cache_usage_perc", frozenset(labels.items()))] == 0
    assert after[("pdserve:admission_reserved_tokens", frozenset({"model_name": MODEL}.items()))] == 0


def test_disconnect_mid_stream_frees_every_block(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        decode = decode_worker(client)
        assert decode["running_requests"] == 1 and decode["used_kv_blocks"] >= 1  # still running
    assert wait_until_no_blocks_used(client) == 0
    assert decode_worker(client)["running_requests"] == 0


def decode_worker(client: httpx.Client) -> dict:
    [decode] = [w for w in client.get("/admin/pools").json()["workers"] if w["role"] == "decode"]
    return dict(decode)


def test_health_and_models(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200
    [model] = client.get("/v1/models").json()["data"]
    assert model["id"] == MODEL and model["max_model_len"] == 1024


def test_admin_pools_shows_both_pools_and_the_blocks_a_request_holds(client: httpx.Client) -> None:
    assert wait_until_no_blocks_used(client) == 0
    idle = client.get("/admin/pools").json()
    assert (idle["prefill"], idle["decode"], idle["mixed"]) == (1, 1, 0)
    assert idle["backend"] in ("nixl", "torch")
    assert sorted(w["role"] for w in idle["workers"]) == ["decode", "prefill"]
    for worker in idle["workers"]:
        assert worker["total_kv_blocks"] == 64  # kv_cache_mib=2 of the tiny model, 16 tokens a block
        assert (worker["free_kv_blocks"], worker["used_kv_blocks"]) == (64, 0)
        assert (worker["running_requests"], worker["waiting_requests"], worker["transferring"]) == (0, 0, 0)
    # A 40-token prompt generating 300 tokens: after 5 events the decode worker runs it and holds its KV.
    body = {"model": MODEL, "prompt": list(range(100, 140)), "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        busy = decode_worker(client)
        assert busy["running_requests"] == 1
        assert busy["used_kv_blocks"] >= 3 and busy["used_kv_blocks"] + busy["free_kv_blocks"] == 64
        rest = [line for line in lines if line]  # read to the end
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert wait_until_no_blocks_used(client) == 0
    for worker in client.get("/admin/pools").json()["workers"]:
        assert (worker["free_kv_blocks"], worker["used_kv_blocks"], worker["running_requests"]) == (64, 0, 0)


def test_each_worker_shows_its_recent_steps(client: httpx.Client) -> None:
    """GET /admin/workers/{id}/steps: the prefill worker's forward carried the prompt, the decode worker's
    one token each; an unknown worker is a 404."""
    started = time.time()
    body = {"model": MODEL, "prompt": list(range(200, 230)), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    workers = {w["role"]: w["worker_id"] for w in client.get("/admin/pools").json()["workers"]}
    prefill = client.get(f"/admin/workers/{workers['prefill']}/steps", params={"since": started}).json()
    decode = client.get(f"/admin/workers/{workers['decode']}/steps", params={"since": started}).json()
    assert sum(s["num_prefill_tokens"] for s in prefill["steps"]) == 30
    assert sum(s["num_decode_tokens"] for s in decode["steps"]) == 7  # the first token came from prefill
    assert all(s["duration_ms"] > 0 and s["started"] >= started for s in decode["steps"])
    missing = client.get("/admin/workers/worker-nobody/steps")
    assert missing.status_code == 404 and "worker-nobody" in missing.json()["error"]["message"]


def test_each_worker_reports_how_it_computes_on_its_own_cores(client: httpx.Client) -> None:
    """dtype, GEMM kernel, threads and pinned cores in /admin/pools, and the same facts in /metrics."""
    workers = client.get("/admin/pools").json()["workers"]
    runtimes = [w["runtime"] for w in workers]
    assert {r["dtype"] for r in runtimes} == {"float32"}  # what the test server asked for
    assert all(set(r["linear_kernel"].split("+")) <= {"torch", "onednn-packed", "zentorch"}
               and r["linear_kernel_reason"] for r in runtimes)
    # K and V × 4 layers × 2 KV heads × head dim 32 × 4 bytes (fp32)
    assert all(r["kv_bytes_per_token"] == 2 * 4 * 2 * 32 * 4 for r in runtimes)
    cores = [tuple(r["cpu_ids"]) for r in runtimes]
    if len(os.sched_getaffinity(0)) >= 2:  # two workers, one thread each: never the same core
        assert all(len(c) == 1 for c in cores) and cores[0] != cores[1]
    text = client.get("/metrics").text
    for worker in workers:
        runtime = worker["runtime"]
        assert (f'pdserve:worker_runtime_info{{compile="{runtime["compile"]}",'
                f'decode_attention="{runtime["decode_attention"]}",'
                f'dtype="float32",kv_dtype="float32",linear_kernel="{runtime["linear_kernel"]}",'
                f'model_name="{MODEL}",'
                f'threads="{runtime["num_threads"]}",weights="unquantized",'
                f'worker="{worker["worker_id"]}"}} 1.0') in text


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ("{not json", 400, "JSON"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": [99999999]}, 400, "vocabulary"),
        ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100}, 400, "context length"),
        ({"model": MODEL, "prompt": [5] * 600, "max_tokens": 400}, 400, "decode worker holds at most"),
    ],
)
def test_bad_input_gets_a_4xx_with_a_message(client: httpx.Client, body: object, status: int,
                                             needle: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    response = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert needle.lower() in error["message"].lower() and error["type"]


def test_keys_are_required(server: str) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(f"{server}/v1/completions", json=body).status_code == 401
    wrong = httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert httpx.get(f"{server}/health").status_code == 200  # no key needed
    assert httpx.get(f"{server}/metrics").status_code == 200  # open to scrapers, as vLLM's (unless told)
    assert httpx.get(f"{server}/admin/pools").status_code == 200  # loopback, no admin key configured


def test_overload_gets_429_and_the_server_keeps_serving(server: str, client: httpx.Client) -> None:
    # Decode KV holds 972 tokens (64 blocks × 16, less the 5% watermark) and one request may wait: of four
    # 460-token requests two run, one waits, one is turned away at once.
    body = {"model": MODEL, "prompt": [3] * 10, "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    statuses = sorted(r.status_code for r in burst(server, body, 4))
    assert statuses == [200, 200, 200, 429]
    assert wait_until_no_blocks_used(client) == 0
    after = client.post("/v1/completions", json={"model": MODEL, "prompt": "still there?", "max_tokens": 2})
    assert after.status_code == 200


def test_429_carries_retry_after(server: str, client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [3] * 10, "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    rejected = [r for r in burst(server, body, 3) if r.status_code == 429]
    assert rejected and int(rejected[0].headers["retry-after"]) >= 1
    assert rejected[0].json()["error"]["type"] == "rate_limit_error"
    assert wait_until_no_blocks_used(client) == 0


def test_a_repeated_prompt_reports_its_cached_tokens(client: httpx.Client, server: str) -> None:
    prompt = list(range(3000, 3050))  # 50 tokens no other test sends: 3 full blocks of 16 can be cached
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()
    assert "prompt_tokens_details" not in first["usage"] and first["timings"]["cached_tokens"] == 0
    before = metric_samples(client)
    second = client.post("/v1/completions", json=body).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 48 and second["timings"]["cached_tokens"] == cached
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # the cache changes no token
    after = metric_samples(client)
    hits = {dict(labels)["worker"]: value - before.get((name, labels), 0.0)
            for (name, labels), value in after.items() if name == "pdserve:prefix_cache_hits_total"}
    assert sorted(hits.values())[-1] == 48  # on the prefill worker that served it
    # The openai SDK reads OpenAI's field, from a stream's usage chunk too.
    sdk = openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY)
    chunks = list(sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 48


def prefill_tokens_computed(client: httpx.Client, since: float) -> int:
    """Prompt tokens the prefill worker's forwards computed since `since` (its step records)."""
    workers = client.get("/admin/pools").json()["workers"]
    [worker] = [w["worker_id"] for w in workers if w["role"] == "prefill"]
    steps = client.get(f"/admin/workers/{worker}/steps", params={"since": since}).json()["steps"]
    return sum(step["num_prefill_tokens"] for step in steps)


def test_a_cache_salt_keeps_each_tenants_prompts_apart(client: httpx.Client) -> None:
    """Review P3: the same prompt under two salts shares no block (the second prefill computes all of it);
    under one salt it shares as any repeated prompt; salted and unsalted never meet."""
    prompt = list(range(3100, 3150))  # 50 tokens no other test sends: 3 full blocks of 16

    def complete(**fields: object) -> tuple[int, int]:
        """(cached_tokens in the answer, prompt tokens the prefill worker computed for it)."""
        since = time.time()
        answer = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                                       "temperature": 0, **fields})
        assert answer.status_code == 200, answer.text
        return answer.json()["timings"]["cached_tokens"], prefill_tokens_computed(client, since)

    assert complete(cache_salt="tenant-a") == (0, 50)
    assert complete(cache_salt="tenant-b") == (0, 50)  # the same prompt, another tenant: computed again
    assert complete(cache_salt="tenant-a") == (48, 2)  # its own tenant's blocks: shared
    assert complete() == (0, 50)  # no salt: the shared chain, where no tenant's blocks are
    assert complete(cache_salt="tenant-b") == (48, 2)
    refused = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "cache_salt": ""})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"


def _freeze_count(_actor: object) -> int:
    import gc  # run on the worker's actor: pickled by value

    return gc.get_freeze_count()


def test_the_gateway_and_every_worker_froze_their_startup_heap(client: httpx.Client) -> None:
    """A full collection over the startup heap (torch, transformers, Ray) stalled every stream for ~200 ms."""
    assert gc.get_freeze_count() > 0  # the gateway runs in this process
    for worker in client.get("/admin/pools").json()["workers"]:
        actor = worker_actor(worker['worker_id'])
        assert ray.get(actor.__ray_call__.remote(_freeze_count)) > 0


@pytest.mark.parametrize("header", ["X-Forwarded-For", "Forwarded", "X-Real-IP"])
def test_admin_routes_without_a_key_refuse_a_request_a_proxy_forwarded(client: httpx.Client,
                                                                       header: str) -> None:
    """Review L2: a server on loopback without --admin-key trusts only direct local requests; a same-host
    reverse proxy connects from loopback too, so its forwarding headers mark the request as not local."""
    assert client.get("/admin/pools").status_code == 200
    refused = client.get("/admin/pools", headers={header: "203.0.113.7"})
    assert refused.status_code == 403 and "proxy" in refused.json()["error"]["message"]
    put = client.put("/admin/pools", json={"auto": False}, headers={header: "203.0.113.7"})
    assert put.status_code == 403
