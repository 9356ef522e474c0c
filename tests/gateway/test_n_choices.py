"""n > 1 through the real two-stage path (1 prefill + 2 decode Ray actors, tiny random Llama with SmolLM2's
tokenizer, float32), with the openai SDK where it can say it: greedy choices are all the n = 1 answer; seeded
choices are reproducible, differ, and choice 0 is the n = 1 answer with that seed; streams interleave the
choices by index and add up to the whole response; usage counts the prompt once; the decode worker holds the
prompt's full blocks once for all choices, and every block is free afterwards; a choice whose decode worker
fails moves on alone; n out of range is a 400 naming `n`; best_of returns the n most likely of its choices,
and is a 400 naming it below n or streamed."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.helpers import actor_faults as faults
from tests.helpers import two_stage_server
from tests.helpers.forced_migration import decode_workers, on_actor, stream_across_a_failure
from tests.helpers.reference import random_prompts
from tests.helpers.servers import MODEL

# The shared server shape's fixtures (tests/helpers/two_stage_server.py), under the names the tests ask for.
server, sdk, client = two_stage_server.shared_two_stage_server, two_stage_server.sdk, two_stage_server.client
VOCAB = 49152
BLOCK = 16
CHAT = [{"role": "user", "content": "Tell me a story about a fox."}]


def block_refs(actor: Any) -> tuple[int, list[int]]:
    """(blocks in use, the ref count of each block in use) of a worker's KV (runs on the actor)."""
    pool = actor.worker.engine.block_pool
    return pool.num_used_blocks, [b.ref_count for b in pool.blocks if b.ref_count]


def completion_tokens(sdk: openai.OpenAI, prompt: list[int], **fields: Any) -> list[list[int]]:
    completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=fields.pop("max_tokens", 12),
                                        extra_body={"return_token_ids": True, "ignore_eos": True}, **fields)
    return [list(c.token_ids) for c in sorted(completion.choices, key=lambda c: c.index)]  # type: ignore[attr-defined]


def test_greedy_choices_are_all_the_single_answer(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([37], VOCAB, seed=31)[0]
    [alone] = completion_tokens(sdk, prompt, temperature=0)
    assert completion_tokens(sdk, prompt, temperature=0, n=3) == [alone] * 3
    chat = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, n=3)  # type: ignore[arg-type]
    one = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert [c.message.content for c in chat.choices] == [one.choices[0].message.content] * 3


def test_seeded_choices_are_reproducible_and_differ(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([45], VOCAB, seed=32)[0]
    first = completion_tokens(sdk, prompt, temperature=1.0, seed=7, n=3)
    assert completion_tokens(sdk, prompt, temperature=1.0, seed=7, n=3) == first
    assert len({tuple(c) for c in first}) > 1
    assert completion_tokens(sdk, prompt, temperature=1.0, seed=7) == first[:1]  # choice 0 keeps the seed


def read_stream(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    assert all("error" not in e for e in events), events
    return events


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_interleaves_the_choices_and_adds_up_to_the_whole(client: httpx.Client, path: str) -> None:
    is_chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 14, "temperature": 1.0, "seed": 11, "n": 3,
                            "ignore_eos": True}
    body |= {"messages": CHAT} if is_chat else {"prompt": "Once upon a time"}
    whole = client.post(path, json=body).json()
    events = read_stream(client, path, {**body, "stream_options": {"include_usage": True}})
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    order = []
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"].get("content") or "" if is_chat else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + delta
            order.append(choice["index"])
            if choice.get("finish_reason"):
                finishes.setdefault(choice["index"], []).append(choice["finish_reason"])
    assert set(texts) == {0, 1, 2}
    assert finishes == {0: ["length"], 1: ["length"], 2: ["length"]}  # each choice's own, once
    assert order != sorted(order), "the choices' chunks come as their tokens do, not one choice after another"
    for choice in whole["choices"]:
        assert texts[choice["index"]] == (choice["message"]["content"] if is_chat else choice["text"])
    usage = events[-1]["usage"]
    # The counts, not prompt_tokens_details: whether the second request's prompt was cached depends on the
    # worker it was routed to (it was on the first's worker in one CI-like run: 32 cached tokens).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {k: usage[k] for k in counts} == {k: whole["usage"][k] for k in counts}
    assert usage["completion_tokens"] == 3 * 14
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3 * 14


def test_usage_counts_the_prompt_once(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([29], VOCAB, seed=33)[0]
    completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=5, n=4, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (29, 20)
    batch = sdk.completions.create(model=MODEL, prompt=[prompt, prompt[:10]], max_tokens=3, n=2,
                                   temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]  # prompt by prompt, choice by choice
    assert batch.usage is not None and (batch.usage.prompt_tokens, batch.usage.completion_tokens) == (39, 12)


def test_the_decode_worker_holds_the_prompt_once(client: httpx.Client) -> None:
    """Mid-stream, the decode worker's blocks: the prompt's full blocks once, each with one reference per
    choice, and per choice only its own tail (the partial prompt block's copy, then its own tokens)."""
    # The server is shared: a worker an earlier test failed may still be starting. Every decode worker must
    # be slowed, or the request may finish on an unslowed one before the first snapshot is taken.
    deadline = time.monotonic() + 180
    while client.get("/health").json()["status"] != "ok" and time.monotonic() < deadline:
        time.sleep(0.2)
    for worker in decode_workers(client):
        on_actor(worker, faults.slow_steps, 0.2)
    prompt = random_prompts([100], VOCAB, seed=34)[0]  # 6 full blocks + 4 tokens
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 1.0, "seed": 5, "n": 3,
            "ignore_eos": True, "stream": True}
    seen: list[tuple[int, list[int]]] = []
    try:
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not seen:  # the first snapshot that finds the choices
                    seen = [s for s in (on_actor(w, block_refs) for w in decode_workers(client)) if s[0]]
    finally:
        for worker in decode_workers(client):
            on_actor(worker, faults.heal)
    [(num_used, refs)] = seen  # one decode worker holds the request
    assert refs.count(3) == 100 // BLOCK  # every full prompt block, shared by the three choices
    # + per choice only its own tail: the partial prompt block's copy (4 tokens), then ≤ 20 of its own tokens.
    assert 100 // BLOCK + 3 <= num_used <= 100 // BLOCK + 3 * 2
    assert num_used < 3 * (100 // BLOCK)  # the prompt is not held three times


def test_n_out_of_range_is_refused_naming_n(client: httpx.Client) -> None:
    for n in (0, 17):
        for path, extra in (("/v1/completions", {"prompt": "x"}),
                            ("/v1/chat/completions", {"messages": CHAT})):
            response = client.post(path, json={"model": MODEL, "max_tokens": 2, "n": n, **extra})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "n"
    # The choices' KV must fit one decode worker (64 blocks of 16 here): the prompt once, n × max_tokens.
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 500, "n": 4})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_best_of_returns_the_n_most_likely_of_its_choices(sdk: openai.OpenAI, client: httpx.Client) -> None:
    """best_of 4, n 2: the four choices n = 4 would draw with that seed, of which the two whose tokens have
    the highest summed logprob come back, best first; usage counts all four."""
    prompt = random_prompts([33], VOCAB, seed=36)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 3,
            "ignore_eos": True, "return_token_ids": True}
    drawn = client.post("/v1/completions", json={**body, "n": 4, "logprobs": 0}).json()["choices"]
    ranked = sorted(drawn, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in ranked]
    assert all(a - b > 1e-3 for a, b in itertools.pairwise(sums)), "no near-tie for a cached prefix to flip"
    assert len({tuple(c["token_ids"]) for c in drawn}) == 4
    best = client.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["token_ids"] for c in best["choices"]] == [c["token_ids"] for c in ranked[:2]]
    assert all("logprobs" not in c for c in best["choices"])  # used to rank, not asked for
    assert best["usage"]["completion_tokens"] == 4 * 6
    with_logprobs = client.post("/v1/completions", json={**body, "best_of": 4, "logprobs": 0}).json()
    [top] = with_logprobs["choices"]
    # Not bit-equal: this prefill reads the earlier ones' cached prefix (a different, equally exact sum).
    assert top["logprobs"]["token_logprobs"] == pytest.approx(ranked[0]["logprobs"]["token_logprobs"],
                                                              abs=1e-4)


def test_best_of_below_n_or_streamed_is_refused_naming_it(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for extra in ({"best_of": 2, "n": 3}, {"best_of": 17}, {"best_of": 2, "stream": True},
                  {"best_of": 16, "max_tokens": 100}):
        response = client.post("/v1/completions", json={**body, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == "best_of", extra
    streamed = client.post("/v1/completions", json={**body, "best_of": 2, "n": 2, "stream": True})
    assert streamed.status_code == 200  # best_of = n keeps every choice: nothing to wait for


def test_a_choice_moves_on_alone_when_its_decode_worker_fails(sdk: openai.OpenAI,
                                                              client: httpx.Client) -> None:
    """The decode worker's step fails mid-stream: every choice moves to the other decode worker on its own
    (recomputing prompt + its tokens so far) and ends as it would have. Last in the module: the failed worker
    is replaced."""
    prompt = random_prompts([40], VOCAB, seed=35)[0]
    [alone] = completion_tokens(sdk, prompt, temperature=0, max_tokens=24)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "n": 2, "ignore_eos": True}
    tokens, _ = stream_across_a_failure(client, body)
    assert tokens == {0: alone, 1: alone}
