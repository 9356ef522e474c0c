"""The chaos run's extra request kinds (tests/reliability/chaoslib/extra_traffic.py), without a server: the
draw, the bodies (the gateway's own request models take them), and the checks of answers right and wrong,
whole and streamed (over httpx's mock transport)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import replace
from typing import Any

import httpx
import pytest

from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from tests.reliability.chaoslib.config import ChaosConfig
from tests.reliability.chaoslib.extra_traffic import (
    EXTRA_KINDS,
    Answer,
    ExtraRequest,
    check_answer,
    extra_body,
    run_extra,
)
from tests.reliability.chaoslib.reference import GreedyPrompt
from tests.reliability.chaoslib.traffic import ChaosRecord, ChaosSpec, build_specs

VOCAB = 1000
POOL = [GreedyPrompt((1, 2, 3), (4, 5, 6))]


def specs(seed: int = 0, duration_s: float = 600.0) -> list[ChaosSpec]:
    return build_specs(ChaosConfig(duration_s=duration_s, seed=seed), POOL, VOCAB, 2048)


def test_about_a_fifth_of_the_arrivals_are_extra_kinds_all_drawn_the_same_for_a_seed() -> None:
    drawn = specs()
    assert drawn == specs()  # the run's seed decides
    extra = [s for s in drawn if s.extra is not None]
    assert 0.15 < len(extra) / len(drawn) < 0.25
    assert {s.kind for s in extra} == set(EXTRA_KINDS)
    assert all(s.kind in EXTRA_KINDS for s in extra) and all(s.kind not in EXTRA_KINDS
                                                              for s in drawn if s.extra is None)
    behaviours = Counter((s.kind, s.behaviour) for s in extra)
    assert behaviours["n_group", "cancel_after"] and behaviours["n_group", "give_up"]
    assert behaviours["best_of", "give_up"] and behaviours["batched", "give_up"]


def test_every_extra_body_is_one_the_gateway_takes() -> None:
    for spec in specs():
        if spec.extra is None:
            continue
        body = extra_body(spec, "m")
        x = spec.extra
        if x.is_chat:
            chat = ChatCompletionRequest.model_validate(body)
            assert (chat.n, chat.max_tokens) == (x.n, spec.max_tokens)
            if spec.kind == "tool_call":
                assert chat.tool_choice is not None and chat.tool_choice.function.name == x.tool_name  # type: ignore[union-attr]
                assert x.tool_name in [t.function.name for t in chat.tools or ()]
            continue
        request = CompletionRequest.model_validate(body)
        assert len(request.prompts) == x.num_prompts
        assert not (request.stream and len(request.prompts) > 1)  # refused by the gateway
        if request.best_of is not None:
            assert request.best_of > request.n and not request.stream
        if spec.kind == "max_tokens_0":
            assert request.max_tokens == 0 and request.echo and request.logprobs is not None
        if spec.kind == "echo_logprobs":
            assert request.echo and request.logprobs in (1, 2, 3)
            assert request.prompt == list(spec.prompt_token_ids)
        if spec.kind == "biased":
            assert request.logit_bias and any(b == -100.0 for b in request.logit_bias.values())


def spec_of(kind: str, extra: ExtraRequest, max_tokens: int = 4, prompt: tuple[int, ...] = (7, 8, 9),
            is_stream: bool = False, behaviour: str = "read", leave_after_tokens: int = 0) -> ChaosSpec:
    return ChaosSpec(3, 0.0, kind, is_stream, behaviour, prompt, max_tokens, (), leave_after_tokens,
                     extra=extra)


def checked(spec: ChaosSpec, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> ChaosRecord:
    record = ChaosRecord(spec.index, spec.kind, spec.is_stream, spec.behaviour, 3, spec.max_tokens,
                         outcome="ok")
    answer = Answer(usage=usage, saw_done=True)
    for choice in choices:
        answer.add(choice, is_whole=True)
    check_answer(record, spec, answer)
    return record


def completion(index: int, ids: list[int], finish: str = "length", **more: Any) -> dict[str, Any]:
    return {"index": index, "text": "x" * len(ids), "finish_reason": finish, "token_ids": ids, **more}


def usage(prompt: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def test_every_choice_of_a_group_or_batch_must_come_back_with_its_finish_reason() -> None:
    group = spec_of("n_group", ExtraRequest(n=3))
    whole = [completion(i, [1, 2, 3, 4]) for i in range(3)]
    assert checked(group, whole, usage(3, 12)).violations == []
    assert checked(group, [*whole[:1], completion(1, [1], "stop"), whole[2]], usage(3, 9)).violations == []
    assert "choices [2] missing" in checked(group, whole[:2], usage(3, 8)).violations[0]
    late = checked(group, [*whole[:2], completion(2, [1, 2], None)], usage(3, 10))  # type: ignore[arg-type]
    assert "choice 2: finish_reason None" in late.violations[0]
    short = checked(group, [*whole[:2], completion(2, [1, 2])], usage(3, 10))
    assert "'length' after 2 of 4" in short.violations[0]
    assert "completion_tokens 11" in checked(group, whole, usage(3, 11)).violations[0]
    batch = spec_of("batched", ExtraRequest(n=2, prompts=((1, 2), (3, 4, 5))), prompt=(1, 2, 3, 4, 5))
    four = [completion(i, [9] * 4) for i in range(4)]
    assert checked(batch, four, usage(5, 16)).violations == []
    assert "choice of index 4" in checked(batch, [*four, completion(4, [9] * 4)], usage(5, 20)).violations[0]
    assert "prompt_tokens 6" in checked(batch, four, usage(6, 16)).violations[0]
    best = spec_of("best_of", ExtraRequest(n=1, best_of=3))
    assert checked(best, [completion(0, [1, 2, 3, 4])], usage(3, 12)).violations == []
    assert "< the 4 tokens" in checked(best, [completion(0, [1, 2, 3, 4])], usage(3, 3)).violations[0]


def chat_call(index: int, name: str, arguments: str, finish: str = "tool_calls") -> dict[str, Any]:
    return {"index": index, "finish_reason": finish, "token_ids": [5] * 20,
            "message": {"role": "assistant", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}}


def test_a_forced_tool_call_names_the_function_with_json_arguments_of_its_schema() -> None:
    spec = spec_of("tool_call", ExtraRequest(is_chat=True, tool_name="get_weather", decoy_tool="book_table"),
                   max_tokens=64)
    use = usage(0, 20)
    good = '{"city": "oslo", "days": 3}'
    assert checked(spec, [chat_call(0, "get_weather", good)], use).violations == []
    assert "calls 'book_table'" in checked(spec, [chat_call(0, "book_table", good)], use).violations[0]
    assert "not JSON" in checked(spec, [chat_call(0, "get_weather", '{"city": ')], use).violations[0]
    no_days = checked(spec, [chat_call(0, "get_weather", '{"city": "oslo"}')], use)
    assert "lack 'days'" in no_days.violations[0]
    assert "not in" in checked(spec, [chat_call(0, "get_weather", '{"city": "rome", "days": 1}')],
                               use).violations[0]
    assert "not a integer" in checked(spec, [chat_call(0, "get_weather", '{"city": "oslo", "days": true}')],
                                      use).violations[0]
    plain = {"index": 0, "finish_reason": "stop", "token_ids": [5] * 20,
             "message": {"role": "assistant", "content": "hello"}}
    assert "not 'tool_calls'" in checked(spec, [plain], use).violations[0]
    cut = {**plain, "finish_reason": "length", "token_ids": [5] * 64}  # cut by max_tokens: not held to it
    assert checked(spec, [cut], usage(0, 64)).violations == []


def test_a_token_biased_by_minus_100_never_comes_out() -> None:
    spec = spec_of("biased", ExtraRequest(logit_bias=((17, -100.0), (18, 5.0))))
    assert checked(spec, [completion(0, [18, 18, 1, 2])], usage(3, 4)).violations == []
    assert "[17], biased by -100" in checked(spec, [completion(0, [1, 17, 2, 3])], usage(3, 4)).violations[0]


def logprobs(num: int, k: int, first_null: bool = True) -> dict[str, Any]:
    lps: list[float | None] = [-1.5] * num
    if first_null:
        lps[0] = None
    tops: list[dict[str, float] | None] = [None] + [{f"t{j}": -1.0 for j in range(k)} for _ in range(num - 1)]
    out: dict[str, Any] = {"tokens": ["a"] * num, "token_logprobs": lps, "text_offset": list(range(num))}
    if k:
        out["top_logprobs"] = tops
    return out


def test_echo_logprobs_cover_the_prompt_and_the_completion() -> None:
    spec = spec_of("echo_logprobs", ExtraRequest(echo=True, logprobs=2), max_tokens=2)
    assert checked(spec, [completion(0, [1, 2], logprobs=logprobs(5, 2))], usage(3, 2)).violations == []
    assert "cover {'tokens': 4" in checked(spec, [completion(0, [1, 2], logprobs=logprobs(4, 2))],
                                           usage(3, 2)).violations[0]
    assert "first token has logprob" in checked(
        spec, [completion(0, [1, 2], logprobs=logprobs(5, 2, first_null=False))], usage(3, 2)).violations[0]
    assert "no logprobs" in checked(spec, [completion(0, [1, 2])], usage(3, 2)).violations[0]
    zero = spec_of("max_tokens_0", ExtraRequest(echo=True, logprobs=0), max_tokens=0)
    assert checked(zero, [completion(0, [], logprobs=logprobs(3, 0))], usage(3, 0)).violations == []
    generated = checked(zero, [completion(0, [4], "stop", logprobs=logprobs(4, 0))], usage(3, 1))
    assert any("max_tokens 0 generated 1" in v for v in generated.violations)


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def run_against(spec: ChaosSpec, content: bytes, status: int = 200) -> ChaosRecord:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=content)

    async def go() -> ChaosRecord:
        record = ChaosRecord(spec.index, spec.kind, spec.is_stream, spec.behaviour, 3, spec.max_tokens)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://x") as client:
            await run_extra(client, spec, extra_body(spec, "m"), record)
        return record

    return asyncio.run(go())


def chat_chunk(index: int, ids: list[int], finish: str | None = None, **delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": delta, "finish_reason": finish, "token_ids": ids}]}


def test_a_streamed_group_interleaved_by_index_is_checked_and_a_client_may_leave_it_mid_group() -> None:
    spec = spec_of("n_group", ExtraRequest(is_chat=True, n=2), max_tokens=2, is_stream=True)
    chunks = [chat_chunk(0, [], role="assistant", content=""),
              chat_chunk(1, [], role="assistant", content=""),
              chat_chunk(0, [1], content="a"), chat_chunk(1, [2], content="b"),
              chat_chunk(1, [3], "length", content="c"), chat_chunk(0, [4], "length", content="d"),
              {"choices": [], "usage": usage(40, 4)}]
    record = run_against(spec, sse(*chunks))
    assert (record.outcome, record.violations, record.num_tokens) == ("ok", [], 4)
    assert record.finish_reason == "length,length"
    missing = run_against(spec, sse(*chunks[:4], chunks[4], {"choices": [], "usage": usage(40, 3)}))
    assert "choice 0: finish_reason None" in missing.violations[0]
    leaving = replace(spec, behaviour="cancel_after", leave_after_tokens=2)
    left = run_against(leaving, sse(*chunks))
    assert (left.outcome, left.violations, left.num_tokens) == ("cancelled", [], 2)
    error = {"error": {"message": "no worker", "type": "server_error", "code": "worker_failed"}}
    failed = run_against(spec, sse(*chunks[:3], error))
    assert (failed.outcome, failed.error_code, failed.violations) == ("error", "stream:worker_failed", [])
    refused = run_against(spec, json.dumps(error).encode(), status=400)
    assert (refused.outcome, refused.error_code) == ("error", "http_400:worker_failed")


def test_a_streamed_forced_call_is_joined_from_its_pieces() -> None:
    spec = spec_of("tool_call", ExtraRequest(is_chat=True, tool_name="convert_units"), max_tokens=64,
                   is_stream=True)
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "convert_units", "arguments": ""}}
    pieces = [chat_chunk(0, [], role="assistant", content=""),
              chat_chunk(0, [1, 2], tool_calls=[first]),
              chat_chunk(0, [3], tool_calls=[{"index": 0, "function": {"arguments": '{"value": 2.5, '}}]),
              chat_chunk(0, [4], "tool_calls",
                         tool_calls=[{"index": 0, "function": {"arguments": '"unit": "km"}'}}]),
              {"choices": [], "usage": usage(300, 4)}]
    record = run_against(spec, sse(*pieces))
    assert (record.outcome, record.violations) == ("ok", [])
    no_done = run_against(spec, sse(*pieces)[: -len(b"data: [DONE]\n\n")])
    assert "without [DONE]" in no_done.violations[0]


@pytest.mark.parametrize("kind", ["best_of", "batched"])
def test_a_whole_group_given_up_is_cancelled(kind: str) -> None:
    spec = next(s for s in specs() if s.kind == kind and s.behaviour == "give_up")

    def slow(request: httpx.Request) -> httpx.Response:
        raise AssertionError("not reached")

    async def go() -> ChaosRecord:
        async def never(request: httpx.Request) -> httpx.Response:
            await asyncio.sleep(60)
            return slow(request)

        record = ChaosRecord(spec.index, spec.kind, spec.is_stream, spec.behaviour, 3, spec.max_tokens)
        quick = replace(spec, leave_after_s=0.05)
        async with httpx.AsyncClient(transport=httpx.MockTransport(never), base_url="http://x") as client:
            await run_extra(client, quick, extra_body(quick, "m"), record)
        return record

    assert asyncio.run(go()).outcome == "cancelled"
