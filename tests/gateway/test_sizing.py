"""A server with a short --max-model-len and a named --kv-cache-memory: /v1/models reports the context it
allows, longer requests get HTTP 400 in vLLM's words at once (completions and chat), shorter ones are served,
a request that names no max_tokens gets what the context leaves, and /admin/pools shows each worker's KV."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import MODEL, serve_config, serving, whole_after

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def client(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[httpx.Client]:
    config = serve_config(tiny_chat_model_dir, api_key=None, mixed=1, max_model_len=MAX_MODEL_LEN,
                          kv_cache_memory="2MiB", kv_cache_mib=None, max_num_seqs=4)
    with serving(config) as (url, _), whole_after(url) as c:
        yield c


def test_models_report_the_context_allowed(client: httpx.Client) -> None:
    [model] = client.get("/v1/models").json()["data"]
    assert model["max_model_len"] == MAX_MODEL_LEN


def test_a_longer_completion_is_refused_with_the_limit(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": [5] * 120, "max_tokens": 20}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == (
        "This model's maximum context length is 128 tokens. However, you requested 140 tokens (120 in the "
        "prompt, 20 in the completion). Please reduce the length of the prompt or completion.")
    assert (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
    too_long = client.post("/v1/completions", json={**body, "prompt": [5] * 130, "max_tokens": 1})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"


def test_a_longer_chat_is_refused_with_the_limit(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "tell me a story " * 40}]}
    response = client.post("/v1/chat/completions", json=body)  # no max_tokens: the prompt alone is too long
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("This model's maximum context length is 128 tokens. However, you requested ")
    assert "in the messages" in message and response.json()["error"]["param"] == "messages"


def test_a_shorter_request_is_served_and_max_tokens_omitted_fits_the_context(client: httpx.Client) -> None:
    served = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 100, "max_tokens": 28,
                                                  "ignore_eos": True})
    assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 28
    # No max_tokens: OpenAI's 16, capped at the 8 tokens the context leaves (as vLLM).
    capped = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 120, "ignore_eos": True})
    assert capped.status_code == 200
    assert capped.json()["usage"]["completion_tokens"] == MAX_MODEL_LEN - 120
    assert capped.json()["choices"][0]["finish_reason"] == "length"
    chat = client.post("/v1/chat/completions", json={"model": MODEL, "ignore_eos": True,
                                                     "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    usage = chat.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN  # the rest of the context


def test_admin_pools_shows_each_workers_kv(client: httpx.Client) -> None:
    [worker] = client.get("/admin/pools").json()["workers"]
    # 2 MiB of the tiny model in float32 (4 layers × 2 (K, V) × 2 KV heads × 32 × 4 bytes = 2 KiB a token):
    # 1024 tokens, 64 blocks of 16.
    assert (worker["total_kv_blocks"], worker["total_kv_tokens"]) == (64, 1024)
    runtime = worker["runtime"]
    assert (runtime["num_kv_blocks"], runtime["num_kv_tokens"]) == (64, 1024)
    assert runtime["kv_cache_bytes"] == 2 << 20
    assert "--kv-cache-memory" in runtime["kv_cache_source"]
