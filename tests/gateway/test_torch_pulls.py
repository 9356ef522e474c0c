"""The torch backend's pull requests (L9): a pull request the decode worker cannot carry to its prefill worker
(the call raises) fails the pull at once, with its reason, and the prompt is recomputed; it does not vanish
and leave the pull to its deadline."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from gateway.config import ServeConfig
from gateway.fleet.adoption import worker_actor
from tests.helpers import actor_faults as faults
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.servers import MODEL, free_port, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow
VOCAB = 49152


@pytest.fixture(scope="module")
def torch_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    config = ServeConfig(dtype="float32", model=str(tiny_chat_model_dir), served_model_name=MODEL,
                         backend="torch", prefill=1, decode=1, port=free_port(), kv_cache_mib=2)
    with serving(config) as (url, _):
        yield url


def test_a_pull_request_that_cannot_be_carried_fails_the_pull_at_once(
        torch_server: str, tiny_chat_model_dir: Path) -> None:
    with httpx.Client(base_url=torch_server, timeout=120) as client:
        workers = client.get("/admin/pools").json()["workers"]
        [prefill] = [worker_actor(w['worker_id']) for w in workers if w["role"] == "prefill"]
        [decode] = [worker_actor(w['worker_id']) for w in workers if w["role"] == "decode"]
        ray.get(prefill.__ray_call__.remote(faults.refuse_pull_calls))
        try:
            prompt = random_prompts([40], VOCAB, seed=30)[0]
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True}
            response = client.post("/v1/completions", json=body)
        finally:
            ray.get(prefill.__ray_call__.remote(faults.heal))
        assert response.status_code == 200, response.text
        data = response.json()
        assert data["choices"][0]["token_ids"] == hf_greedy(tiny_chat_model_dir, [prompt], 6)[0]
        assert data["timings"]["transfer_bytes"] == 0  # recomputed on the decode worker
        [record] = [r for r in ray.get(decode.transfer_records.remote()) if r.role == "recv"][-1:]
        assert record.outcome == "FAILED" and "the pull request failed" in record.reason, record
        assert wait_until_no_blocks_used(client) == 0
