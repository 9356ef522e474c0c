"""Tensor-parallel workers through the whole server: a one-rank prefill worker hands its KV over NIXL to
two-rank decode workers (each a group of Ray actors: rank 0 the worker's own, the other on its node,
pool_worker/tp_ranks.py); greedy tokens equal one rank's, and a rank killed mid-stream takes its worker down
as one unit while the stream completes on the other decode worker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray

from gateway.fleet.adoption import worker_actor
from llm_engine import EngineConfig, LLMEngine
from llm_engine.params import SamplingParams
from tests.helpers import actor_faults as faults
from tests.helpers.forced_migration import on_actor, stream_across_a_failure
from tests.helpers.servers import MODEL, serve_config, serving, wait_until_whole, whole_after

pytestmark = pytest.mark.slow
PROMPT = list(range(300, 340))


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    """1 prefill worker of one rank, 2 decode workers of two ranks: five processes, half a CPU each."""
    config = serve_config(tiny_chat_model_dir, prefill=1, decode=2, decode_tp=2, cpus_per_worker=0.5,
                          backend="nixl", kv_cache_mib=4, api_key=None, max_waiting=8)
    with serving(config, start_timeout_s=300) as (url, _):  # five model loads on two cores
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


def decode_workers(client: httpx.Client) -> list[str]:
    return [w["worker_id"] for w in client.get("/admin/pools").json()["workers"] if w["role"] == "decode"]


def test_kv_from_one_rank_to_two_gives_one_ranks_greedy_tokens(client: httpx.Client,
                                                               one_rank_tokens: list[int]) -> None:
    for worker in decode_workers(client):  # its other rank is a live actor of its own, in the worker's group
        assert rank_actor(worker, 1) is not None
        assert rank_group(worker) == ("CREATED", "STRICT_PACK", 2)
    runtimes = {w["role"]: w["runtime"] for w in client.get("/admin/pools").json()["workers"]}
    assert runtimes["decode"]["tensor_parallel_size"] == 2 and len(runtimes["decode"]["tp_rank_pids"]) == 1
    assert runtimes["prefill"]["tensor_parallel_size"] == 1
    # NIXL: each rank reads its own heads, so rank 0 keeps no whole-head staging copy of the cache.
    assert runtimes["decode"]["tp_kv_handoff"] == "rank slices" and runtimes["prefill"]["tp_kv_handoff"] == ""
    # The bytes a token's KV moves are the same whole-head bytes at either degree.
    assert runtimes["decode"]["kv_bytes_per_token"] == runtimes["prefill"]["kv_bytes_per_token"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    for _ in range(2):  # the second reads its prompt from the prefix cache
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == one_rank_tokens
        assert response.json()["timings"]["transfer_bytes"] > 0  # handed over, not recomputed


def test_a_stream_evacuated_between_two_rank_workers_continues_from_its_pulled_kv(
        client: httpx.Client, one_rank_tokens: list[int]) -> None:
    """Migration between decode workers of two ranks: each rank of the new worker reads its heads of the
    stream's KV (prompt and tokens so far) from the rank of the old one that holds them."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    evacuated: list[str] = []

    def evacuate(worker_id: str) -> None:
        evacuated.append(worker_id)
        ray.get(worker_actor(worker_id).evacuate.remote())

    tokens, moves = stream_across_a_failure(client, body, breaker=evacuate)
    on_actor(evacuated[0], faults.heal)
    assert tokens == {0: one_rank_tokens}
    assert moves == [1]  # continued on the other decode worker
    records = on_actor(evacuated[0], _sent_records)
    assert [r.outcome for r in records] == ["PULLED"], records  # its KV was pulled, not recomputed
    assert wait_until_whole(client) is None


def _sent_records(actor: object) -> list[object]:
    migration = actor.worker.offers  # type: ignore[attr-defined]
    return list(migration.sender.recorder.records)


def kill_rank_1(worker_id: str) -> None:
    ray.kill(rank_actor(worker_id, 1))


def test_a_killed_rank_takes_its_worker_down_and_the_stream_completes_elsewhere(
        client: httpx.Client, one_rank_tokens: list[int]) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    killed: list[str] = []

    def kill_and_note(worker_id: str) -> None:
        killed.append(worker_id)
        kill_rank_1(worker_id)

    tokens, moves = stream_across_a_failure(client, body, breaker=kill_and_note)
    assert tokens == {0: one_rank_tokens}
    assert moves and moves[0] >= 1  # continued on the other decode worker
    assert wait_until_whole(client) is None  # the gateway replaced the worker whose rank died
    with pytest.raises(ValueError):  # and ended its rank 0 as one unit with the dead rank
        worker_actor(killed[0])


def test_an_idle_worker_whose_rank_dies_is_replaced_before_any_request_finds_it(
        client: httpx.Client, one_rank_tokens: list[int]) -> None:
    """An idle worker runs no all-reduce that would fail: its load() sees the rank gone (review P7), so the
    gateway replaces it without a request having to fail there first."""
    [victim, *_] = decode_workers(client)
    kill_rank_1(victim)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _has_actor(victim):
        time.sleep(0.2)
    assert not _has_actor(victim), "the worker with a dead rank was not replaced"
    assert wait_until_whole(client) is None
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == one_rank_tokens


def test_a_worker_whose_rank_0_dies_leaves_no_rank_behind(client: httpx.Client,
                                                           one_rank_tokens: list[int]) -> None:
    """Ray ends the ranks a worker's actor owns with it: no orphan keeps CPUs or memory, and the replacement
    starts a group of its own."""
    [victim, *_] = decode_workers(client)
    rank_1 = rank_actor(victim, 1)
    ray.kill(worker_actor(victim))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(rank_1):
        time.sleep(0.5)
    assert not _alive(rank_1), "rank 1 outlived its worker"
    assert wait_until_whole(client) is None  # replaced
    assert rank_group(victim)[0] == "REMOVED"  # its ranks' resources went back to the cluster
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["token_ids"] == one_rank_tokens


def rank_group(worker_id: str) -> tuple[str, str, int]:
    """(state, strategy, bundles) of the placement group of a worker's ranks (gateway/fleet/rank_groups)."""
    [group] = [g for g in ray.util.placement_group_table().values()
               if g["name"].endswith(f"{worker_id}.ranks")]  # named after its worker's actor
    return group["state"], group["strategy"], len(group["bundles"])


def rank_actor(worker_id: str, rank: int) -> Any:
    """The actor of a worker's rank (named after the worker's actor, whose name its keeper prefixes)."""
    [name] = [n for n in ray.util.list_named_actors() if n.endswith(f"{worker_id}-rank{rank}")]
    return ray.get_actor(name)


def _has_actor(worker_id: str) -> bool:
    try:
        worker_actor(worker_id)
    except ValueError:
        return False
    return True


def _alive(actor: object) -> bool:
    try:
        ray.get(actor.num_steps.remote(), timeout=5)  # type: ignore[attr-defined]
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


def test_a_put_that_sets_the_prefill_degree_replaces_the_prefill_worker_and_keeps_the_tokens(
        client: httpx.Client, one_rank_tokens: list[int]) -> None:
    """PUT /admin/pools with prefill_tp: a two-rank prefill worker is added, then the one-rank one drained;
    the KV now moves between two-rank workers, and greedy tokens stay one rank's. A degree that does not
    divide the heads, and auto with the roles at different degrees, are refused before anything moves.
    (Last in the module: the layout it leaves is not the one the others start from.)"""
    before = {w["worker_id"]: w for w in client.get("/admin/pools").json()["workers"]}
    layout = {"prefill": 1, "decode": 2}
    odd = client.put("/admin/pools", json={**layout, "prefill_tp": 3})
    assert odd.status_code == 400 and "prefill_tp 3 does not split" in odd.json()["error"]["message"]
    auto = client.put("/admin/pools", json={"auto": True})
    assert auto.status_code == 400 and "degree 1" in auto.json()["error"]["message"]
    assert client.put("/admin/pools", json={"auto": True, "prefill_tp": 2}).status_code in (400, 422)

    answer = client.put("/admin/pools", json={**layout, "prefill_tp": 2})
    assert answer.status_code == 200 and answer.json()["error"] == "", answer.text
    [old_prefill] = [w for w, v in before.items() if v["role"] == "prefill"]
    assert [m["action"] for m in answer.json()["moves"]] == ["add", "drain"]
    assert answer.json()["done"][-1] == f"drained {old_prefill}"
    assert answer.json()["tensor_parallel"] == {"prefill": 2, "decode": 2, "mixed": 2}
    pools = client.get("/admin/pools").json()
    assert pools["tensor_parallel"]["prefill"] == 2
    [prefill] = [w for w in pools["workers"] if w["role"] == "prefill"]
    assert prefill["worker_id"] not in before and prefill["tensor_parallel_size"] == 2
    assert prefill["runtime"]["tensor_parallel_size"] == 2
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/completions", json=body)
    assert response.json()["choices"][0]["token_ids"] == one_rank_tokens
    assert response.json()["timings"]["transfer_bytes"] > 0
