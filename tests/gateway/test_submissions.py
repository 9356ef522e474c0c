"""The gateway's batched decode submissions (gateway/fleet/submissions.py, through the worker client)
against a small real Ray actor that answers submit_decodes as a decode worker does: one call per worker per
event-loop turn, refusals per request, a lost worker reaches everyone (as WorkerLost)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from decode_pool.messages import DecodeRequest
from gateway.fleet.output_streams import RequestOutputs
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.worker_errors import SubmissionRefused, WorkerLost
from llm_engine import SamplingParams


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


async def submit(client: WorkerClient, decode_request: DecodeRequest) -> None:
    await client.submit_decode(decode_request, RequestOutputs(decode_request.request_id, "ch"))


def test_one_call_per_turn_with_refusals(ray_local: None) -> None:
    actor = RecordingDecodeActor.remote()  # type: ignore[attr-defined]

    async def scenario() -> None:
        client = WorkerClient("decode-0", actor, "gateway-test")
        started = [asyncio.create_task(submit(client, request(f"r{i}"))) for i in range(3)]
        refused = asyncio.create_task(submit(client, request("empty", ())))
        await asyncio.gather(*started)
        with pytest.raises(SubmissionRefused, match="empty prompt"):
            await refused
        await submit(client, request("later"))  # a later turn: a call of its own

    asyncio.run(scenario())
    assert ray.get(actor.calls_seen.remote()) == [["r0", "r1", "r2", "empty"], ["later"]]


def test_a_lost_worker_fails_every_request_of_the_batch(ray_local: None) -> None:
    actor = RecordingDecodeActor.remote()  # type: ignore[attr-defined]
    ray.kill(actor)

    async def scenario() -> list[BaseException | None]:
        client = WorkerClient("decode-0", actor, "gateway-test")
        return await asyncio.gather(*(submit(client, request(f"r{i}")) for i in range(2)),
                                    return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, WorkerLost) for o in outcomes), outcomes


def test_a_batch_refused_before_it_leaves_reaches_every_submitter() -> None:
    """A batch call that raises as it is made (before any answer could come) fails each of its submitters
    at once, rather than leaving them to wait (a group of choices has no deadline of its own there)."""
    from gateway.fleet.submissions import Submissions

    def send(requests: list[DecodeRequest], channel_id: str) -> asyncio.Future[list[str]]:
        raise TypeError("cannot serialise the batch")

    async def run() -> list[BaseException | None]:
        submissions: Submissions[DecodeRequest] = Submissions(send)
        async with asyncio.timeout(5):
            return await asyncio.gather(*(submissions.submit(request(f"r{i}"), "ch") for i in range(3)),
                                        return_exceptions=True)

    assert [type(e) for e in asyncio.run(run())] == [TypeError] * 3
