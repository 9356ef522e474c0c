"""Tensor-parallel workers through the whole server: each worker a group of Ray actors (rank 0 the worker's
own, the others on its node: pool_worker/tp_ranks.py), greedy tokens equal to one rank's, and a rank killed
mid-stream takes its worker down as one unit while the stream completes on the other worker."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray

from gateway.config import ServeConfig
from llm_engine import EngineConfig, LLMEngine
from llm_engine.sampling import SamplingParams
from tests.helpers import actor_faults as faults
from tests.helpers.forced_migration import on_actor
from tests.helpers.servers import MODEL, serve_config, serving, whole_after

pytestmark = pytest.mark.slow
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    """Two mixed workers of two ranks each: four processes, half a CPU each."""
    config = serve_config(tiny_chat_model_dir, tensor_parallel_size=2, mixed=2, cpus_per_worker=0.5,
                          kv_cache_mib=4, api_key=None, max_waiting=8)
    with serving(config) as (url, _):
        yield url


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:
        yield c


@pytest.fixture(scope="module")
def one_rank_tokens(tiny_chat_model_dir: Path) -> list[int]:
    engine = LLMEngine(EngineConfig(str(tiny_chat_model_dir), dtype="float32", device="cpu", compile="off",
                                    kv_cache_bytes=4 << 20))
    [done] = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0))
    return list(done.output_token_ids)


def test_two_rank_workers_give_one_ranks_greedy_tokens(client: httpx.Client, one_rank_tokens: list[int]
                                                       ) -> None:
    workers = client.get("/admin/pools").json()["workers"]
    assert [w["role"] for w in workers] == ["mixed", "mixed"]
    for worker in workers:  # its other rank is a live actor of its own
        assert ray.get_actor(f"pdserve-{worker['worker_id']}-rank1") is not None
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    for _ in range(2):  # the second reads its prompt from the prefix cache
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == one_rank_tokens


def test_a_killed_rank_takes_its_worker_down_and_the_stream_completes_elsewhere(
        client: httpx.Client, one_rank_tokens: list[int]) -> None:
    workers = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]]
    for worker in workers:
        on_actor(worker, faults.slow_steps, 0.05)
    tokens: list[int] = []
    moves: list[int] = []
    killed = ""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                tokens.extend(choice.get("token_ids") or [])
                if choice.get("finish_reason") and event.get("timings"):
                    moves.append(event["timings"]["num_moves"])
            if len(tokens) >= 6 and not killed:
                [killed] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
                            if w.get("running_requests", 0) > 0]
                ray.kill(ray.get_actor(f"pdserve-{killed}-rank1"))
    assert killed, "the stream ended before a rank could be killed"
    assert tokens == one_rank_tokens
    assert moves and moves[0] >= 1  # continued on the other worker
    for worker in workers:
        if worker != killed:
            on_actor(worker, faults.heal)
    # whole_after: the gateway replaced the worker whose rank died (a new group of two ranks) and all is ok.


def test_roles_other_than_mixed_are_refused_while_workers_are_tensor_parallel(client: httpx.Client) -> None:
    response = client.put("/admin/pools", json={"prefill": 1, "decode": 1, "mixed": 0})
    assert response.status_code in (400, 409, 422), response.text
    assert "tensor-parallel" in response.text
    assert [w["role"] for w in client.get("/admin/pools").json()["workers"]] == ["mixed", "mixed"]


@pytest.mark.parametrize(("flags", "named"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "prefill": 1, "decode": 1}, "--tensor-parallel-size 2: tensor-parallel "
                                                             "workers serve in the mixed role only"),
    ({"tensor_parallel_size": 3}, "--tensor-parallel-size 3 does not divide the model's 8 attention heads"),
])
def test_bad_tensor_parallel_settings_are_refused_naming_the_flag(
        tiny_chat_model_dir: Path, flags: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ServeConfig(model=str(tiny_chat_model_dir), **flags)  # type: ignore[arg-type]
