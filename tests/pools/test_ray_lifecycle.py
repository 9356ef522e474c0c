"""Pools on Ray: a client that goes away mid-stream frees every block; workers are added and drained."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.worker_errors import LastDecoder
from gateway.requests.events import StreamEvent
from gateway.requests.orchestrator import run_request
from gateway.requests.router import Router
from llm_engine import EngineConfig, SamplingParams
from tests.helpers.reference import random_prompts
from worker_runtime.roles import Role

pytestmark = pytest.mark.usefixtures("ray_local")


def config_for(model_dir: Path) -> DeploymentConfig:
    pytest.importorskip("nixl")
    return DeploymentConfig(EngineConfig(str(model_dir), dtype="float32",
                                         kv_cache_bytes=16 << 20), backend="nixl")


async def wait_whole(deployment: PDDeployment, timeout_s: float = 10.0) -> dict[str, bool]:
    whole: dict[str, bool] = {}
    for _ in range(int(timeout_s / 0.05)):
        whole = {w.worker_id: await w.client.is_whole() for w in deployment.workers.values()}
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
    """Added workers serve requests; a worker drained while it decodes one finishes it, then stops."""

    async def events_of(router: Router, request_id: str, prompt: list[int], sampling: SamplingParams,
                        ) -> list[StreamEvent]:
        return [e async for e in run_request(router, request_id, tuple(prompt), sampling)]

    async def scenario() -> dict[str, object]:
        deployment = PDDeployment(config_for(tiny_llama_dir))
        await deployment.start()
        router = Router(deployment)
        [old_prefill], [old_decode] = ([w.worker_id for w in deployment.active(role)]
                                       for role in (Role.PREFILL, Role.DECODE))
        try:
            new_decode = await deployment.add_worker("decode")
            new_prefill = await deployment.add_worker("prefill")
            roles_after_add = sorted(load.role for load in await deployment.loads())
            # Route the next requests to the new workers: the old ones look busy.
            router.decode_tokens[old_decode] += 10_000
            router.prefill_tokens[old_prefill] += 10_000
            short = SamplingParams(max_tokens=5, temperature=0.0)
            served = await events_of(router, "r0", random_prompts([10], 1000)[0], short)
            handle = served[0].prefill.kv_handle if served[0].prefill is not None else None
            pulled = await deployment.workers[new_decode].client.transfer_records()

            # A long request on the new decode worker; drain that worker once it is decoding.
            long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
            prompt = random_prompts([20], 1000, seed=2)[0]
            stream = run_request(router, "r1", tuple(prompt), long)
            events = [await anext(stream), await anext(stream)]  # the prefill's token, then a decode step
            is_busy_at_drain = not await deployment.workers[new_decode].client.is_whole()
            drain = asyncio.ensure_future(deployment.drain_worker(new_decode))
            await asyncio.sleep(0)
            routed_while_draining = router.pick_decode().worker_id
            async for event in stream:
                events.append(event)
            await drain
            is_gone = new_decode not in deployment.workers
            await deployment.drain_worker(new_prefill)
            with pytest.raises(LastDecoder, match="last active worker that can decode"):
                await deployment.drain_worker(old_decode)
            # The same request again, served by the workers that remain: the reference output.
            router.decode_tokens[old_decode] -= 10_000
            router.prefill_tokens[old_prefill] -= 10_000
            reference = await events_of(router, "r2", prompt, long)
            return {
                "old_decode": old_decode,
                "roles_after_add": roles_after_add,
                "roles_after_drain": sorted(load.role for load in await deployment.loads()),
                "handle": handle, "pulled": pulled, "new_prefill": new_prefill,
                "num_short_tokens": sum(len(e.token_ids) for e in served),
                "is_busy_at_drain": is_busy_at_drain, "routed_while_draining": routed_while_draining,
                "new_decode": new_decode, "is_gone": is_gone, "events": events, "reference": reference,
            }
        finally:
            await deployment.shutdown()

    result = asyncio.run(scenario())
    assert result["roles_after_add"] == ["decode", "decode", "prefill", "prefill"]
    assert result["roles_after_drain"] == ["decode", "prefill"]
    assert result["num_short_tokens"] == 5
    # Served by the added pair: the new prefill worker offered the KV, and the new decode worker pulled it.
    handle = result["handle"]
    assert handle is not None and handle.source_worker_id == result["new_prefill"]
    assert [(r.source_worker_id, r.transfer_id, r.outcome) for r in result["pulled"]] == [
        (result["new_prefill"], handle.transfer_id, "DONE")
    ]
    # Drained mid-request: it was holding the request, took no new one, and stopped only after finishing it
    # with the same tokens the remaining workers produce for the same request.
    assert result["is_busy_at_drain"] and result["routed_while_draining"] == result["old_decode"]
    events, reference = result["events"], result["reference"]
    assert events[-1].finish_reason == "length" and reference[-1].finish_reason == "length"
    tokens = [t for e in events for t in e.token_ids]
    assert len(tokens) == 300 and tokens == [t for e in reference for t in e.token_ids]
    assert result["is_gone"]
