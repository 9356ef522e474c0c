"""PUT /admin/pools on a real server (Ray actors, tiny Llama, nixl): layouts change under a steady stream of
requests and nothing is lost; bad layouts are refused before anything moves; one change at a time."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from fastapi import FastAPI

from gateway.config import ServeConfig
from gateway.fleet.adoption import worker_actor
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import PoolResizer, ResizeConflict
from gateway.requests.router import LocalPrefillPolicy, Router
from gateway.serve_settings import controller_policy, planner_settings
from llm_engine import EngineConfig
from tests.helpers import actor_faults as faults
from tests.helpers.reference import hf_greedy, random_prompts
from tests.helpers.servers import MODEL, free_port, serving, wait_until_no_blocks_used
from worker_runtime.info import WorkerInfo

pytestmark = pytest.mark.slow
VOCAB = 49152


@pytest.fixture(scope="module")
def running(tiny_chat_model_dir: Path, ray_local: None) -> Any:
    pytest.importorskip("nixl")
    config = ServeConfig(dtype="float32",
                         model=str(tiny_chat_model_dir), served_model_name=MODEL, backend="nixl",
                         port=free_port(), kv_cache_mib=2, max_num_batched_tokens=64,
                         enable_prompt_tokens_details=True)  # the local-prefill reason in timings
    with serving(config) as served:
        yield served


@pytest.fixture
def url(running: tuple[str, FastAPI]) -> str:
    return running[0]


@pytest.fixture
def client(url: str) -> Any:
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def layout_of(client: httpx.Client) -> tuple[int, int, int]:
    pools = client.get("/admin/pools").json()
    return pools["prefill"], pools["decode"], pools["mixed"]


class SteadyLoad:
    """Greedy requests one after another from two threads until stopped; remembers every answer."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client
        self.answers: list[tuple[list[int], httpx.Response]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in (1, 2)]

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)

    def _run(self, seed: int) -> None:
        index = 0
        while not self._stop.is_set():
            [prompt] = random_prompts([8 + (index * 7) % 40], VOCAB, seed=100 * seed + index)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                    "return_token_ids": True}
            self.answers.append((prompt, self.client.post("/v1/completions", json=body)))
            index += 1


def worker_infos(client: httpx.Client) -> dict[str, WorkerInfo]:
    """Each worker's own account of itself (role, process, weight loads), asked of its actor."""
    ids = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]]
    return {i: ray.get(worker_actor(i).info.remote()) for i in ids}


def change_layout(client: httpx.Client, layout: dict[str, int]) -> dict[str, Any]:
    response = client.put("/admin/pools", json=layout)
    assert response.status_code == 200, response.text
    assert response.json()["error"] == ""
    assert layout_of(client) == (layout["prefill"], layout["decode"], layout["mixed"])
    time.sleep(0.5)  # some requests on this layout
    return dict(response.json())


def check_answers(load: SteadyLoad, model_dir: Path) -> None:
    assert len(load.answers) > 8
    failed = [r.text for _, r in load.answers if r.status_code != 200]
    assert not failed, failed
    expected_tokens = hf_greedy(model_dir, [p for p, _ in load.answers], 6)
    assert [r.json()["choices"][0]["token_ids"] for _, r in load.answers] == expected_tokens


def test_roles_change_in_place_under_load_and_every_request_is_served(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    before = worker_infos(client)
    with SteadyLoad(client) as load:
        to_mixed = change_layout(client, {"prefill": 0, "decode": 0, "mixed": 2})
        mixed = worker_infos(client)
        back = change_layout(client, {"prefill": 1, "decode": 1, "mixed": 0})
    check_answers(load, tiny_chat_model_dir)
    # Both layout changes were role changes of the same two processes: no worker added or removed, the
    # weights loaded once in each, and decode ⇄ mixed was only a relabel.
    assert [m["action"] for m in to_mixed["moves"] + back["moves"]] == ["change"] * 4
    after = worker_infos(client)
    assert set(before) == set(mixed) == set(after)
    assert {i: (x.actor_id, x.pid, x.num_model_loads) for i, x in after.items()} == {
        i: (x.actor_id, x.pid, 1) for i, x in before.items()}
    assert {x.role.value for x in mixed.values()} == {"mixed"}
    assert sorted(x.role.value for x in after.values()) == ["decode", "prefill"]
    assert wait_until_no_blocks_used(client) == 0
    workers = client.get("/admin/pools").json()["workers"]
    assert all(w["state"] == "active" for w in workers)


def test_pools_grow_and_shrink_under_load_and_every_request_is_served(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    with SteadyLoad(client) as load:
        grown = change_layout(client, {"prefill": 1, "decode": 2, "mixed": 0})
        shrunk = change_layout(client, {"prefill": 1, "decode": 1, "mixed": 0})
    check_answers(load, tiny_chat_model_dir)
    assert [m["action"] for m in grown["moves"] + shrunk["moves"]] == ["add", "drain"]
    assert wait_until_no_blocks_used(client) == 0
    workers = client.get("/admin/pools").json()["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["state"] == "active" for w in workers)


def test_a_stream_moves_off_a_worker_that_changes_role_with_its_kv_without_losing_a_token(
        client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    change_layout(client, {"prefill": 0, "decode": 0, "mixed": 2})
    actors = [worker_actor(i) for i in worker_infos(client)]
    # The engine keeps the slowdown across role changes.
    ray.get([a.__ray_call__.remote(faults.slow_steps, 0.02) for a in actors])
    try:
        [prompt] = random_prompts([20], VOCAB, seed=41)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 80, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "stream": True}
        token_ids: list[int] = []
        final: dict[str, Any] = {}
        change: list[httpx.Response] = []
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                token_ids += chunk["choices"][0]["token_ids"] or []
                final = chunk
                if len(token_ids) >= 10 and not change:  # mid-stream: the worker holding it becomes prefill
                    body_ = {"prefill": 1, "decode": 1, "mixed": 0, "drain_grace_s": 0}
                    change.append(client.put("/admin/pools", json=body_))
        assert change[0].status_code == 200 and change[0].json()["error"] == "", change[0].text
    finally:
        ray.get([a.__ray_call__.remote(faults.heal) for a in actors])
    assert token_ids == hf_greedy(tiny_chat_model_dir, [prompt], 80, ignore_eos=True)[0]
    assert final["timings"]["num_moves"] == 1
    # The worker it moved to pulled the stream's KV from the one it left (nixl), rather than recomputing it.
    assert final["timings"]["transfer_bytes"] > 0
    assert layout_of(client) == (1, 1, 0)
    assert wait_until_no_blocks_used(client) == 0


@pytest.mark.parametrize(("body", "words"), [
    ({"prefill": -1, "decode": 1}, "greater than or equal to 0"),
    ({"prefill": 0, "decode": 0, "mixed": 0}, "cannot serve"),
    ({"prefill": 0, "decode": 2}, "cannot serve"),
    ({"prefill": 2, "decode": 0}, "cannot serve"),
    ({"prefill": 1, "decode": 1, "gpus": 3}, "gpus: Extra inputs are not permitted"),
    ({"prefill": 1000, "decode": 1}, "more workers, asking for 999 CPU ("),
    ({"prefill": "1", "decode": 1}, "integer"),
    # A grace as long as the drain timeout: every drain of a busy worker would time out, stranding it.
    ({"prefill": 1, "decode": 1, "drain_grace_s": 300}, "drain_grace_s (300 s) must be below the drain"),
])
def test_bad_layouts_are_refused_before_anything_moves(client: httpx.Client, body: dict[str, Any],
                                                       words: str) -> None:
    def layout() -> list[tuple[str, str, str]]:  # what a move would change (not the live load figures)
        return [(w["worker_id"], w["role"], w["state"]) for w in client.get("/admin/pools").json()["workers"]]

    before = layout()
    response = client.put("/admin/pools", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    assert layout() == before


def test_a_second_change_while_one_applies_is_a_conflict(client: httpx.Client) -> None:
    slow: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: slow.append(
        client.put("/admin/pools", json={"prefill": 1, "decode": 2})), daemon=True)
    thread.start()
    for _ in range(200):
        if client.get("/admin/pools").json()["change_in_progress"]:
            break
        time.sleep(0.02)
    second = client.put("/admin/pools", json={"prefill": 2, "decode": 1})
    assert second.status_code == 409
    assert second.json()["error"]["type"] == "conflict_error"
    thread.join(120)
    assert slow[0].status_code == 200 and layout_of(client) == (1, 2, 0)
    assert client.put("/admin/pools", json={"prefill": 1, "decode": 1}).status_code == 200
    assert layout_of(client) == (1, 1, 0)


def test_the_torch_backend_cannot_resize(tiny_llama_dir: Path) -> None:
    engine = EngineConfig(str(tiny_llama_dir), dtype="float32")
    deployment = PDDeployment(DeploymentConfig(engine, backend="torch"))
    resizer = PoolResizer(deployment, Router(deployment))
    with pytest.raises(ResizeConflict, match="fixes its workers"):
        resizer.check(PoolLayout(prefill=1, decode=2))


def test_short_prompts_are_prefilled_on_the_decode_worker_when_asked(
        client: httpx.Client, running: tuple[str, FastAPI], tiny_chat_model_dir: Path) -> None:
    app = running[1]
    config: ServeConfig = app.state.config
    router = app.state.service.router

    def set_policy(policy: LocalPrefillPolicy) -> None:
        """The routers' policy is the fleet's: set there (as a rejoining supervisor does), then followed."""
        app.state.control.rejoin(controller_policy(config), policy, False, planner_settings(config))
        deadline = time.monotonic() + 10
        while router.local_prefill != policy:
            assert time.monotonic() < deadline, "the frontend never took the fleet's policy"
            time.sleep(0.01)

    set_policy(LocalPrefillPolicy(max_uncached_tokens=16))
    try:
        short, long = random_prompts([10, 40], VOCAB, seed=31)
        answers = [complete_greedy(client, prompt) for prompt in (short, long)]
    finally:
        set_policy(LocalPrefillPolicy())
    assert [a["choices"][0]["token_ids"] for a in answers] == hf_greedy(tiny_chat_model_dir, [short, long], 6)
    local, pooled = (a["timings"] for a in answers)
    assert local["prefill_on"] == "decode" and "10 uncached tokens <= 16" in local["local_prefill_reason"]
    assert local["transfer_bytes"] == 0
    assert pooled["prefill_on"] == "prefill" and pooled["transfer_bytes"] > 0
    assert wait_until_no_blocks_used(client) == 0


def complete_greedy(client: httpx.Client, prompt: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())
