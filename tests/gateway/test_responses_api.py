"""/v1/responses without Ray or a model: the request → chat mapping, the field checks, the writer's event
sequence, and the error handler's field paths. The route through the SDKs and both stages on Ray:
test_responses_api_e2e.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api.bad_request import BadRequest
from gateway.api.errors import install_error_handlers
from gateway.api.protocol import ChatCompletionRequest
from gateway.api.reasoning import PARSERS, ReasoningParserName, ReasoningStream
from gateway.api.responses_api.mapping import check_supported, in_responses_terms, to_chat
from gateway.api.responses_api.objects import ResponseObject
from gateway.api.responses_api.protocol import ResponsesRequest
from gateway.api.responses_api.writer import ResponseWriter
from gateway.api.tool_parsers import HermesParser
from gateway.requests.prepared import TextDelta

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": MODEL, "input": "hi", **fields})


# The mapping.

def test_instructions_and_items_become_the_chat_request() -> None:
    body = request(
        instructions="Be brief.", max_output_tokens=7, top_p=0.5, tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Let me look.", "annotations": [],
                             "logprobs": []}]},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}",
                "id": "fc_1", "status": "completed"},
               {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
               {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "a"},
                                                                    {"type": "input_text", "text": "b"}]}])
    check_supported(body)
    chat = to_chat(body, MODEL).request
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief."), ("user", "Weather in Paris?"), ("assistant", "Let me look."),
        ("tool", "21 C"), ("developer", "ab")]
    [call] = chat.messages[2].tool_calls or []  # the call joins the assistant turn it follows
    assert (call.id, call.function.name, call.function.arguments) == ("call_1", "get_weather", "{}")
    assert chat.messages[3].tool_call_id == "call_1"
    assert chat.max_completion_tokens == 7 and chat.top_p == 0.5 and chat.temperature == 1.0  # chat's default
    assert chat.tools is not None and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert chat.tool_choice is not None and chat.tool_choice.function.name == "get_weather"  # type: ignore[union-attr]
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == {"type": "object"}


def test_a_string_input_is_one_user_message_and_calls_alone_make_an_assistant_turn() -> None:
    assert [(m.role, m.content) for m in to_chat(request(), MODEL).request.messages] == [("user", "hi")]
    calls = [{"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"} for i in range(2)]
    chat = to_chat(request(input=[{"role": "user", "content": "x"}, *calls]), MODEL)
    assert [m.role for m in chat.request.messages] == ["user", "assistant"]
    assert chat.request.messages[1].content is None and len(chat.request.messages[1].tool_calls or []) == 2
    assert chat.origins[1].call_paths == ["input[1]", "input[2]"]


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"store": True}, "store", "store: false"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
    ({"background": True}, "background", "server-side state"),
    ({"include": ["message.output_text.logprobs"]}, "include", "no extra output"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "not supported"),
    ({"truncation": "auto"}, "truncation", "disabled"),
    ({"frequency_penalty": 1}, "frequency_penalty", "unknown field"),
    ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "input[0].name", "unknown field"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x", "cache": 1}]}]},
     "input[0].content[0].cache", "unknown field"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading", "unknown field"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
])
def test_what_pdserve_cannot_honour_is_refused_by_name(fields: dict[str, Any], param: str, words: str
                                                       ) -> None:
    with pytest.raises(BadRequest) as raised:
        check_supported(request(**fields))
    assert raised.value.param == param and words in str(raised.value), str(raised.value)


def test_values_that_ask_for_nothing_are_accepted() -> None:
    check_supported(request(store=False, previous_response_id=None, include=[], truncation="disabled",
                            reasoning=None, service_tier="auto", metadata={"k": "v"}, user="u"))


def test_a_chat_400_is_renamed_to_what_the_client_sent() -> None:
    calls = [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{"},
             {"type": "function_call_output", "call_id": "c9", "output": "x"}]
    chat = to_chat(request(instructions="sys", input=[{"role": "user", "content": "x"}, *calls]), MODEL)
    cases = [("messages[3].tool_call_id", "input[2].call_id"),
             ("messages[2].tool_calls[0].function.arguments", "input[1].arguments"),
             ("messages[0].content", "instructions"), ("max_tokens", "max_output_tokens"),
             ("response_format", "text.format"), ("tool_choice", "tool_choice")]
    for chat_param, param in cases:
        renamed = in_responses_terms(BadRequest(f"{chat_param}: bad", param=chat_param), chat.origins)
        assert (renamed.param, str(renamed)) == (param, f"{param}: bad")
    long = BadRequest("5 tokens (5 in the messages, 1 in the completion). Please reduce the length of the "
                      "messages or completion.", param="messages", code="context_length_exceeded")
    renamed = in_responses_terms(long, chat.origins)
    assert renamed.param == "input" and "the messages" not in str(renamed) and "the input" in str(renamed)


# The writer.

def delta(text: str, finish_reason: str | None = None, num_output_tokens: int = 0) -> TextDelta:
    return TextDelta(text=text, token_ids=(1,), logprobs=(0.0,), finish_reason=finish_reason,
                     num_output_tokens=num_output_tokens, num_cached_tokens=3 if finish_reason else 0)


def writer(parser: HermesParser | None = None, thoughts: ReasoningStream | None = None) -> ResponseWriter:
    template = ResponseObject(id="req-1", status="in_progress", model=MODEL, temperature=1.0, top_p=1.0,
                              tool_choice="auto", text={"format": {"type": "text"}})
    return ResponseWriter(template, num_prompt_tokens=10, parser=parser, thoughts=thoughts)


def run(w: ResponseWriter, texts: list[str], finish_reason: str = "stop") -> list[Any]:
    events: list[Any] = w.start()
    for i, text in enumerate(texts):
        is_last = i == len(texts) - 1
        events += w.feed(delta(text, finish_reason if is_last else None, num_output_tokens=i + 1))
    return events


def test_a_text_stream_is_openais_event_sequence() -> None:
    w = writer()
    events = run(w, ["Hel", "lo", ""])
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello"
    assert events[6].text == "Hello" and events[7].part.text == "Hello"
    assert events[8].item.status == "completed"
    final = events[-1].response
    assert final == w.response and final.status == "completed" and final.incomplete_details is None
    assert final.output[0].content[0].text == "Hello"  # type: ignore[union-attr]
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (10, 3)
    assert final.usage.total_tokens == 13 and final.usage.input_tokens_details.cached_tokens == 3


def test_a_length_cut_is_incomplete_and_nothing_written_is_an_empty_message() -> None:
    events = run(writer(), ["ab"], finish_reason="length")
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert final.output[0].status == "incomplete"
    empty = run(writer(), [""])
    assert [e.type for e in empty][2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert empty[-1].response.output[0].content[0].text == ""


def test_a_tool_call_streams_as_a_function_call_item() -> None:
    text = "Let me look.\n" + CALL_TEXT
    events = run(writer(HermesParser()), [text[i:i + 5] for i in range(0, len(text), 5)])
    kinds = [e.type for e in events]
    call_added = kinds.index("response.output_item.added", 3)
    assert kinds[2:call_added] == [
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * (
            kinds[2:call_added].count("response.output_text.delta")),
        "response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    added = events[call_added]
    assert added.output_index == 1 and added.item.type == "function_call" and added.item.arguments == ""
    assert added.item.name == "get_weather" and added.item.call_id.startswith("call_")
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert json.loads("".join(fragments)) == {"city": "Paris"}
    message, call = events[-1].response.output
    assert message.content[0].text.strip() == "Let me look."
    assert call.status == "completed" and json.loads(call.arguments) == {"city": "Paris"}
    assert events[-3].arguments == call.arguments and events[-3].name == "get_weather"


QWEN3 = PARSERS[ReasoningParserName.QWEN3]


def test_the_thinking_streams_as_a_reasoning_item_before_the_answer() -> None:
    """--reasoning-parser qwen3: the text up to </think> is a reasoning item (reasoning_text events, as vLLM's
    Responses API writes them), the rest the message; a tag cut across deltas is still found."""
    texts = ["<think>\nThe user", " greets. </th", "ink>\n\nHel", "lo", ""]
    events = run(writer(thoughts=QWEN3.stream()), texts)
    kinds = [e.type for e in events]
    assert kinds[2:5] == ["response.output_item.added", "response.reasoning_text.delta",
                          "response.reasoning_text.delta"]
    assert events[2].item.type == "reasoning" and events[2].item.id.startswith("rs_")
    done = kinds.index("response.reasoning_text.done")
    assert kinds[done + 1:done + 3] == ["response.output_item.done", "response.output_item.added"]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == events[done].text == "\nThe user greets. "
    final = events[-1].response
    reasoning, message = final.output
    assert (reasoning.type, reasoning.status) == ("reasoning", "completed")
    assert reasoning.content[0].text == thought
    assert reasoning.summary == [] and reasoning.encrypted_content is None
    assert message.type == "message" and message.content[0].text == "\n\nHello"
    assert final.usage.output_tokens_details.reasoning_tokens == 2  # the deltas wholly inside the thinking


def test_thinking_cut_by_max_output_tokens_is_all_reasoning_and_the_message_is_empty() -> None:
    events = run(writer(thoughts=QWEN3.stream()), ["<think>so", " then"], finish_reason="length")
    final = events[-1].response
    reasoning, message = final.output
    assert reasoning.content[0].text == "so then" and reasoning.status == "completed"
    assert message.content[0].text == "" and message.status == "incomplete"
    assert final.status == "incomplete"


def test_with_thinking_off_or_a_grammar_the_whole_output_is_the_answer() -> None:
    events = run(writer(thoughts=QWEN3.stream(starts_in_reasoning=False)), ["Hel", "lo"])
    assert [item.type for item in events[-1].response.output] == ["message"]


def test_reasoning_items_sent_back_become_the_assistant_turns_reasoning() -> None:
    """The openai-agents SDK sends the previous output back whole: reasoning, message, function calls."""
    body = request(input=[
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Say it."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "21 C."}]},
        {"role": "user", "content": "Thanks"}], tools=[WEATHER])
    check_supported(body)
    chat = to_chat(body, MODEL).request
    assert [(m.role, m.content, m.reasoning) for m in chat.messages] == [
        ("user", "Weather?", None), ("assistant", "", "Need the tool."), ("tool", "21 C", None),
        ("assistant", "21 C.", "Say it."), ("user", "Thanks", None)]
    assert chat.messages[1].tool_calls is not None and chat.messages[1].tool_calls[0].id == "call_1"
    with pytest.raises(BadRequest, match=r"input\[1\]\.encrypted"):
        check_supported(request(input=[{"role": "user", "content": "a"}, {
            "type": "reasoning", "content": [], "encrypted": "x"}]))


def test_a_failure_after_the_start_ends_with_error_and_response_failed() -> None:
    w = writer()
    events: list[Any] = w.start() + w.feed(delta("a")) + w.fail("no worker could finish", "worker_failed")
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert events[-2].code == "worker_failed"
    assert events[-1].response.error.message == "no worker could finish"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_chat_validation_error_names_the_whole_path() -> None:
    """The error handler keeps every request model's field names: nested tool fields included."""
    chat = FastAPI()
    install_error_handlers(chat)

    @chat.post("/chat")
    async def echo(body: ChatCompletionRequest) -> dict[str, str]:
        return {}

    tool = {"type": "function", "function": {"name": "f", "parameters": "x"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    error = TestClient(chat).post("/chat", json=body).json()["error"]
    assert error["param"] == "tools[0].function.parameters"
