"""The gateway's batched decode submissions (gateway/fleet/submissions.py) against a small real Ray actor
that answers submit_decodes as a decode worker does: one call per worker per event-loop turn, refusals per
request, a lost worker reaches everyone."""

from __future__ import annotations

import asyncio

import pytest
import ray

from decode_pool.messages import DecodeRequest
from gateway.fleet.submissions import Submissions
from gateway.fleet.workers import Worker
from llm_engine import SamplingParams
from pool_worker import Role


@ray.remote
class RecordingDecodeActor:
    """Takes every request but those with an empty prompt, and remembers each call's requests."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def submit_decodes(self, requests: list[DecodeRequest], channel_id: str) -> list[str]:
        self.calls.append([r.request_id for r in requests])
        return ["" if r.prompt_token_ids else "an empty prompt cannot be served" for r in requests]

    def calls_seen(self) -> list[list[str]]:
        return self.calls


def request(request_id: str, prompt: tuple[int, ...] = (1, 2, 3)) -> DecodeRequest:
    return DecodeRequest(request_id, prompt, SamplingParams(max_tokens=4))


async def submit(submissions: Submissions, worker: Worker, decode_request: DecodeRequest) -> None:
    await submissions.submit(worker, "submit_decodes", decode_request, "ch")


def test_one_call_per_turn_with_refusals(ray_local: None) -> None:
    actor = RecordingDecodeActor.remote()  # type: ignore[attr-defined]
    worker = Worker("decode-0", Role.DECODE, actor)

    async def scenario() -> None:
        submissions = Submissions()
        started = [asyncio.create_task(submit(submissions, worker, request(f"r{i}"))) for i in range(3)]
        refused = asyncio.create_task(submit(submissions, worker, request("empty", ())))
        await asyncio.gather(*started)
        with pytest.raises(ValueError, match="empty prompt"):
            await refused
        await submit(submissions, worker, request("later"))  # a later turn: a call of its own

    asyncio.run(scenario())
    assert ray.get(actor.calls_seen.remote()) == [["r0", "r1", "r2", "empty"], ["later"]]


def test_a_lost_worker_fails_every_request_of_the_batch(ray_local: None) -> None:
    actor = RecordingDecodeActor.remote()  # type: ignore[attr-defined]
    ray.kill(actor)
    worker = Worker("decode-0", Role.DECODE, actor)

    async def scenario() -> list[BaseException | None]:
        submissions = Submissions()
        return await asyncio.gather(*(submit(submissions, worker, request(f"r{i}")) for i in range(2)),
                                    return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, ray.exceptions.RayActorError) for o in outcomes), outcomes
