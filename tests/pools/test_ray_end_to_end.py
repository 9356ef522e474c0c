"""1 prefill + 1 decode Ray actor, 16 concurrent requests through the real KV handoff (nixl, torch/gloo);
and each supported model family through the same handoff."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.requests.events import StreamEvent
from gateway.requests.orchestrator import run_request
from gateway.requests.router import Router
from llm_engine import EngineConfig, SamplingParams
from llm_engine.tiny_model import TINY_FAMILIES, build_tiny_model
from tests.helpers.reference import hf_greedy, random_prompts

pytestmark = pytest.mark.usefixtures("ray_local")


async def serve_all(config: DeploymentConfig, prompts: list[list[int]], sampling: SamplingParams,
                    ) -> tuple[list[list[int]], list[list[StreamEvent]], dict[str, bool]]:
    deployment = PDDeployment(config)
    await deployment.start()
    router = Router(deployment)

    async def one(index: int, prompt: list[int]) -> list[StreamEvent]:
        return [e async for e in run_request(router, f"req-{index}", tuple(prompt), sampling)]

    try:
        events = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        await asyncio.sleep(0.2)  # the prefill side sees the last pull notifications and frees
        whole = {w.worker_id: await w.client.is_whole() for w in deployment.workers.values()}
    finally:
        await deployment.shutdown()
    tokens = [[t for e in stream for t in e.token_ids] for stream in events]
    return tokens, events, whole


@pytest.mark.parametrize("backend", ["nixl", "torch"])
def test_sixteen_concurrent_requests_match_transformers(tiny_llama_dir: Path, backend: str) -> None:
    if backend == "nixl":
        pytest.importorskip("nixl")
    prompts = random_prompts([3, 9, 17, 25, 33, 40, 48, 57, 64, 80, 96, 100, 128, 150, 200, 250], 1000)
    sampling = SamplingParams(max_tokens=16, temperature=0.0)
    config = DeploymentConfig(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=16 << 20,
                                           max_num_batched_tokens=256), backend=backend)
    tokens, events, whole = asyncio.run(serve_all(config, prompts, sampling))
    assert tokens == hf_greedy(tiny_llama_dir, prompts, 16)
    assert all(whole.values()), whole
    for stream in events:
        final = stream[-1]
        assert final.finish_reason == "length" and final.decode is not None and final.decode.times is not None
        prefill_times, decode_times = stream[0].prefill.times, final.decode.times  # type: ignore[union-attr]
        assert prefill_times.queued <= prefill_times.started <= prefill_times.finished
        assert decode_times.transfer_started is not None and decode_times.transfer_finished is not None
        assert decode_times.transfer_started <= decode_times.transfer_finished <= decode_times.finished
        assert final.decode.transfer_bytes > 0


# 17-37 s each on 2 cores (two actors load per family): slow. The fast suite carries every family through the
# same handoff in one process (tests/pools/test_handoff_in_process.py).
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(TINY_FAMILIES) - {"llama"}))  # llama: the test above
def test_each_family_through_one_prefill_and_one_decode(family: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    prompts = random_prompts([6, 37], 1000)
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    config = DeploymentConfig(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=4 << 20),
                              backend="auto")
    tokens, _, whole = asyncio.run(serve_all(config, prompts, sampling))
    assert tokens == hf_greedy(model_dir, prompts, 4)
    assert all(whole.values()), whole


@pytest.mark.slow
def test_smollm2_through_nixl(smollm2_dir: Path) -> None:
    pytest.importorskip("nixl")
    prompts = random_prompts([12, 70, 130], 49152)
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    config = DeploymentConfig(EngineConfig(str(smollm2_dir), dtype="float32",
                                           kv_cache_bytes=64 << 20), backend="nixl")
    tokens, _, whole = asyncio.run(serve_all(config, prompts, sampling))
    assert tokens == hf_greedy(smollm2_dir, prompts, 12)
    assert all(whole.values()), whole
