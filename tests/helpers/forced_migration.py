"""A stream carried across a decode worker that fails mid-stream, for the OpenAI-surface suites: whatever
shapes sampling (penalties, a grammar, several choices) must survive the stream's recomputation elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import ray

from gateway.fleet.adoption import worker_actor
from tests.helpers import actor_faults as faults


def on_actor(worker_id: str, fn: Any, *args: object) -> Any:
    return ray.get(worker_actor(worker_id).__ray_call__.remote(fn, *args))


def decode_workers(client: httpx.Client) -> list[str]:
    return [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
            if w["role"] == "decode" and w["state"] == "active"]


def break_next_step(worker_id: str) -> None:
    on_actor(worker_id, faults.raise_in_next_step)


def stream_across_a_failure(client: httpx.Client, body: dict[str, Any], after_tokens: int = 6,
                            breaker: Callable[[str], None] = break_next_step
                            ) -> tuple[dict[int, list[int]], list[int]]:
    """Stream a completions `body` (return_token_ids is set) with every decode worker slowed, and break the
    one running it (`breaker`, given its worker id) once each choice has `after_tokens` tokens. Returns each
    choice's token ids, and the num_moves of every final chunk that carries timings. Asserts no error event
    and that a worker was broken. The broken worker is replaced: call last in a module."""
    for worker in decode_workers(client):
        on_actor(worker, faults.slow_steps, 0.05)
    tokens: dict[int, list[int]] = {}
    moves: list[int] = []
    broken = ""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True, "return_token_ids": True}
                       ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                tokens.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
                if choice.get("finish_reason") and event.get("timings"):
                    moves.append(event["timings"]["num_moves"])
            if tokens and min(map(len, tokens.values())) >= after_tokens and not broken:
                [broken] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
                            if w["role"] == "decode" and w.get("running_requests", 0) > 0]
                breaker(broken)
    assert broken, "the stream ended before a worker could be broken"
    for worker in decode_workers(client):
        if worker != broken:
            on_actor(worker, faults.heal)
    return tokens, moves
