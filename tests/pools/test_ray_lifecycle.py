"""Pools on Ray: a client that goes away mid-stream frees every block; workers are added and drained."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.orchestrator import run_request
from gateway.pools import DeploymentConfig, PDDeployment
from gateway.router import Router
from llm_engine import EngineConfig, SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.usefixtures("ray_local")


def config_for(model_dir: Path) -> DeploymentConfig:
    pytest.importorskip("nixl")
    return DeploymentConfig(EngineConfig(str(model_dir), kv_cache_bytes=16 << 20), backend="nixl")


async def wait_whole(deployment: PDDeployment, timeout_s: float = 10.0) -> dict[str, bool]:
    whole: dict[str, bool] = {}
    for _ in range(int(timeout_s / 0.05)):
        whole = {w.worker_id: await w.actor.is_whole.remote() for w in deployment.workers.values()}
        if all(whole.values()):
            break
        await asyncio.sleep(0.05)
    return whole


def test_stream_closed_mid_decode_and_mid_prefill_frees_blocks(tiny_llama_dir: Path) -> None:
    async def scenario() -> dict[str, bool]:
        deployment = PDDeployment(config_for(tiny_llama_dir))
        await deployment.start()
        router = Router(deployment)
        long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        try:
            prompt = tuple(random_prompts([40], 1000)[0])
            stream = run_request(router, "gone-while-decoding", prompt, long)
            async for event in stream:
                if len(event.token_ids) and event.decode is None and event.prefill is None:
                    break  # a decode token arrived: the client disconnects now
            await stream.aclose()
            # And one that goes away while its 900-token prompt is still being prefilled.
            big = tuple(random_prompts([900], 1000, seed=3)[0])
            task = asyncio.ensure_future(anext(run_request(router, "gone-while-prefilling", big, long)))
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return await wait_whole(deployment)
        finally:
            await deployment.shutdown()

    whole = asyncio.run(scenario())
    assert whole and all(whole.values()), whole


def test_add_and_drain_workers(tiny_llama_dir: Path) -> None:
    async def scenario() -> tuple[list[str], list[str], list[int]]:
        deployment = PDDeployment(config_for(tiny_llama_dir))
        await deployment.start()
        router = Router(deployment)
        try:
            new_decode = await deployment.add_worker("decode")
            new_prefill = await deployment.add_worker("prefill")
            roles_after_add = sorted(load.role for load in await deployment.loads())
            # The new workers serve requests: route the next ones to them first.
            router.decode_tokens["decode-1"] += 10_000
            router.prefill_tokens["prefill-0"] += 10_000
            sampling = SamplingParams(max_tokens=5, temperature=0.0)
            lengths = []
            for index, prompt in enumerate(random_prompts([10, 20], 1000)):
                events = [e async for e in run_request(router, f"r{index}", tuple(prompt), sampling)]
                lengths.append(sum(len(e.token_ids) for e in events))
            await deployment.drain_worker(new_decode)
            await deployment.drain_worker(new_prefill)
            with pytest.raises(ValueError, match="last active decode worker"):
                await deployment.drain_worker("decode-1")
            roles_after_drain = sorted(load.role for load in await deployment.loads())
            return roles_after_add, roles_after_drain, lengths
        finally:
            await deployment.shutdown()

    after_add, after_drain, lengths = asyncio.run(scenario())
    assert after_add == ["decode", "decode", "prefill", "prefill"]
    assert after_drain == ["decode", "prefill"]
    assert lengths == [5, 5]
