"""Clearing a worker for a long prompt, on real worker actors (local Ray, tiny Llama, nixl): the streams
decoding on the mixed worker chosen to prefill a long prompt move to the other worker with their KV before
its chunks run, and every output stays token-identical to the same request served alone."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.deployment import PDDeployment
from gateway.requests.router import LocalPrefillPolicy, Router
from llm_engine import SamplingParams
from tests.helpers import actor_faults as faults
from tests.helpers.fleets import call_on, events_of, tokens, until, with_deployment
from tests.helpers.reference import random_prompts
from worker_runtime.roles import Role

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]
STREAM = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
LONG_PROMPT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_a_long_prompt_moves_the_streams_off_its_worker_first(tiny_llama_dir: Path) -> None:
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        a, b = deployment.active(Role.MIXED)
        router.local_prefill = LocalPrefillPolicy(isolate_prompts_from_tokens=300,
                                                  move_streams_from_tokens=300)
        short, long = random_prompts([40, 400], 1000, seed=21)
        references = [tokens(await events_of(router, f"ref{i}", p, s))
                      for i, (p, s) in enumerate([(short, STREAM), (long, LONG_PROMPT)])]
        for worker in (a, b):
            await call_on(worker, faults.slow_steps, 0.03)  # the streams are still decoding when it comes
        streams = [asyncio.ensure_future(events_of(router, f"s{i}", short, STREAM)) for i in range(2)]
        await until(lambda: all(f"s{i}" in a.client.request_ids() + b.client.request_ids() for i in range(2)))
        await asyncio.sleep(0.5)  # one stream on each worker, past its first tokens
        placed = {w.worker_id: list(w.client.request_ids()) for w in (a, b)}
        long_events = await events_of(router, "long", long, LONG_PROMPT)
        stream_events = await asyncio.gather(*streams)
        wholes = [await w.client.is_whole() for w in (a, b)]
        return {"references": references, "placed": placed, "long": long_events, "streams": stream_events,
                "wholes": wholes}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=0, num_decode=0, num_mixed=2)
    assert sorted(len(ids) for ids in result["placed"].values()) == [1, 1]
    assert tokens(result["long"]) == result["references"][1]
    moved = [events for events in result["streams"] if events[-1].num_moves]
    # The stream on the long prompt's worker moved, once, with its KV (pulled, not recomputed); the other
    # stayed. Both are token-identical to the stream served alone.
    assert len(moved) == 1 and moved[0][-1].num_moves == 1 and moved[0][-1].num_migrations == 0
    final = moved[0][-1].decode
    assert final is not None and final.transfer_bytes > 0
    assert all(tokens(events) == result["references"][0] for events in result["streams"])
    assert result["wholes"] == [True, True]
