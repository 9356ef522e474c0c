"""vLLM's request extensions in the gateway's plain-Python parts (no Ray, no server): the request models take
every extension at its default, admission orders the line by priority, the detokenizer keeps or drops stop
strings and special tokens as asked, bad words become vLLM's token sequences, structured_outputs becomes a
grammar or a 400 naming the field, and nested objects refuse keys they do not know."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from gateway.api.bad_request import BadRequest
from gateway.api.extensions import bad_word_token_ids, echoed_message, template_kwargs, truncated_prompt
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.protocol_extensions import StructuredOutputs
from gateway.api.structured import structured_outputs_grammar
from gateway.requests.admission import Admission
from gateway.requests.detokenizer import IncrementalDetokenizer
from llm_engine.structured import GrammarKind

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# Every extension at vLLM's default value: asks for nothing.
DEFAULTS: dict[str, Any] = {
    "min_p": 0.0, "top_k": -1, "bad_words": [], "allowed_token_ids": None, "prompt_logprobs": None,
    "truncate_prompt_tokens": None, "skip_special_tokens": True, "include_stop_str_in_output": False,
    "return_tokens_as_token_ids": False, "structured_outputs": None, "priority": 0,
}
CHAT_DEFAULTS: dict[str, Any] = {"add_generation_prompt": True, "continue_final_message": False,
                                 "chat_template_kwargs": {}, "echo": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


def test_every_extension_at_its_default_is_accepted_and_model_is_optional() -> None:
    chat = ChatCompletionRequest.model_validate({**CHAT, **DEFAULTS, **CHAT_DEFAULTS})
    assert chat.model is None and not chat.model_extra
    completion = CompletionRequest.model_validate({"prompt": "x", **DEFAULTS})
    assert completion.model is None and not completion.model_extra


@pytest.mark.parametrize(("body", "where"), [
    ({**CHAT, "response_format": {"type": "json_object", "strict": True}}, "strict"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}]}, "cache"),
    ({**CHAT, "stream_options": {"include_usage": True, "per_token": True}}, "per_token"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strictly": True}}]}, "strictly"),
    ({**CHAT, "structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "backend"),
])
def test_nested_objects_refuse_keys_they_do_not_know(body: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationError) as raised:
        ChatCompletionRequest.model_validate(body)
    assert any(e["type"] == "extra_forbidden" and e["loc"][-1] == where for e in raised.value.errors())


def test_admission_line_is_ordered_by_priority_then_arrival() -> None:
    async def run() -> list[str]:
        admission = Admission(capacity_tokens=10, max_waiting=8, timeout_s=5, max_waiting_tokens=100)
        holding = admission.try_acquire(10)
        assert holding is not None
        order: list[str] = []

        async def wait(name: str, priority: int) -> None:
            reservation = await admission.acquire(10, priority)
            order.append(name)
            await asyncio.sleep(0)
            reservation.release()

        tasks = []
        for name, priority in (("late-5", 5), ("first-0", 0), ("second-0", 0), ("urgent", -3), ("mid-1", 1)):
            tasks.append(asyncio.create_task(wait(name, priority)))
            await asyncio.sleep(0)  # each takes its place in line in this order
        holding.release()
        await asyncio.gather(*tasks)
        assert admission.reserved_tokens == 0 and admission.num_waiting == 0
        return order

    assert asyncio.run(run()) == ["urgent", "first-0", "second-0", "mid-1", "late-5"]


def test_stop_strings_are_cut_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("The cat sat on the mat. Then it slept.")
    for include, expected in ((False, "The cat sat on the"), (True, "The cat sat on the mat")):
        detokenizer = IncrementalDetokenizer(tokenizer, [" mat", " it"], include_stop_str_in_output=include)
        text = "".join(detokenizer.add([t]) for t in ids) + detokenizer.flush()
        assert detokenizer.is_stopped and text == expected


def test_special_tokens_are_skipped_unless_asked(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("Hi"), 1, *tokenizer.encode(" there")]  # 1: <|im_start|>, a special token
    for skip, expected in ((True, "Hi there"), (False, "Hi<|im_start|> there")):
        detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert detokenizer.add(ids) + detokenizer.flush() == expected


def test_bad_words_are_tokenized_alone_and_after_a_space(tokenizer: Any) -> None:
    sequences = bad_word_token_ids(tokenizer, ["hello", "  world peace"])
    assert tuple(tokenizer.encode("hello", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode(" hello", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode("world peace", add_special_tokens=False)) in sequences
    assert tuple(tokenizer.encode(" world peace", add_special_tokens=False)) in sequences
    assert bad_word_token_ids(tokenizer, None) == ()


def test_truncation_keeps_the_end_of_the_prompt() -> None:
    prompt = list(range(100))
    assert truncated_prompt(prompt, 10, 64) == list(range(90, 100))
    assert truncated_prompt(prompt, -1, 64) == list(range(36, 100))
    assert truncated_prompt(prompt, None, 64) == prompt
    with pytest.raises(BadRequest) as raised:
        truncated_prompt(prompt, 65, 64)
    assert raised.value.param == "truncate_prompt_tokens"


@pytest.mark.parametrize(("outputs", "kind"), [
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}, GrammarKind.JSON_SCHEMA),
    ({"json": '{"type": "array"}'}, GrammarKind.JSON_SCHEMA),
    ({"json_object": True}, GrammarKind.JSON_SCHEMA),
    ({"regex": "[a-c]{3}"}, GrammarKind.REGEX),
    ({"choice": ["yes", "no"]}, GrammarKind.CHOICE),
    ({"grammar": 'start: "a" | "b"'}, GrammarKind.GRAMMAR),
    ({"grammar": 'root ::= "x" "y"'}, GrammarKind.GRAMMAR),  # GBNF, as llama.cpp and vLLM's docs write it
])
def test_structured_outputs_become_grammars(outputs: dict[str, Any], kind: GrammarKind) -> None:
    spec = structured_outputs_grammar(StructuredOutputs.model_validate(outputs))
    assert spec is not None and spec.kind is kind


@pytest.mark.parametrize(("outputs", "param"), [
    ({"regex": "[a-", }, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({}, "structured_outputs"),
    ({"json_object": True, "whitespace_pattern": " *"}, "structured_outputs.whitespace_pattern"),
    ({"json_object": True, "structural_tag": "{}"}, "structured_outputs.structural_tag"),
])
def test_structured_outputs_refused_name_the_field(outputs: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        structured_outputs_grammar(StructuredOutputs.model_validate(outputs))
    assert raised.value.param == param


def test_chat_rendering_checks_and_echo() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "An apple a day"}]
    both = ChatCompletionRequest.model_validate({"messages": messages, "continue_final_message": True})
    with pytest.raises(BadRequest, match="add_generation_prompt"):
        template_kwargs(both)
    reserved = ChatCompletionRequest.model_validate({**CHAT, "chat_template_kwargs": {"tokenize": False}})
    with pytest.raises(BadRequest) as raised:
        template_kwargs(reserved)
    assert raised.value.param == "chat_template_kwargs.tokenize"
    assert template_kwargs(ChatCompletionRequest.model_validate(
        {**CHAT, "chat_template_kwargs": {"enable_thinking": False}})) == {"enable_thinking": False}
    # echo: the last message's text when it has the answer's role (vLLM's rule).
    continued = {"messages": messages, "echo": True, "add_generation_prompt": False}
    assert echoed_message(ChatCompletionRequest.model_validate(continued)) == "An apple a day"
    assert echoed_message(ChatCompletionRequest.model_validate({**CHAT, "echo": True})) == ""
    assert echoed_message(ChatCompletionRequest.model_validate({"messages": messages, "echo": True})) == (
        "An apple a day")
