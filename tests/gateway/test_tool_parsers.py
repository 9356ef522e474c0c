"""Tool-call parsers without a server: each family's output read into calls whole and streamed (the streamed
deltas join into the whole answer, id/type/name before any argument fragment, whatever the cut points); the
parser detected from chat templates; history checks that name the bad field."""

from __future__ import annotations

import json

import pytest

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.api.tool_parsers import HermesParser, Llama3JsonParser, ToolCallParser, choose_parser
from gateway.api.tool_prompt import plan_tools, template_messages
from gateway.api.tool_responses import ToolCallStream, whole_message

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2]}}; {"name": "get_time", ' \
         '"parameters": {}}'
EXPECTED = [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})]


@pytest.mark.parametrize(("parser", "text", "content"), [(HermesParser(), HERMES, "Let me check."),
                                                          (Llama3JsonParser(), LLAMA3, None)])
def test_whole_and_streamed_answers_read_the_same_calls(parser: ToolCallParser, text: str,
                                                        content: str | None) -> None:
    message, finish = whole_message(parser, text, "stop")
    assert finish == "tool_calls" and message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == EXPECTED
    for step in (1, 3, 7, len(text)):
        stream = ToolCallStream(parser)
        chunks = [text[i : i + step] for i in range(0, len(text), step)]
        deltas = [d for i, c in enumerate(chunks) for d in stream.feed(c, is_final=i == len(chunks) - 1)]
        assert stream.finish_reason("stop") == "tool_calls"
        streamed_content = "".join(d.content or "" for d in deltas)
        assert streamed_content == (content or "")
        calls: dict[int, dict[str, str]] = {}
        for piece in (p for d in deltas for p in d.tool_calls or []):
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name  # header first
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == EXPECTED


def test_plain_answers_and_prose_about_tags_stay_content() -> None:
    for text in ("Just an answer.", "I would write <tool_call> here but won't", "<tool_call>\nnot json\n"
                 "</tool_call>"):
        message, finish = whole_message(HermesParser(), text, "stop")
        assert message.content == text and message.tool_calls is None and finish == "stop"
    message, _ = whole_message(Llama3JsonParser(), "Paris is sunny.", "stop")
    assert message.content == "Paris is sunny."


def test_a_stream_holds_back_what_may_open_a_call() -> None:
    stream = ToolCallStream(HermesParser())
    assert [d.content for d in stream.feed("Hi <tool_", False)] == ["Hi "]
    assert [d.content for d in stream.feed("box>", True)] == ["<tool_box>"]


@pytest.mark.parametrize(("template", "name"), [
    ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "hermes"),
    ("{%- if tools %}<tool_call>{%- endif %}", "hermes"),
    ("<|start_header_id|>{{ m }}<|eot_id|>{%- if tools %}<|python_tag|>{% endif %}", "llama3_json"),
    (None, "hermes")])
def test_the_parser_is_detected_from_the_template(template: str | None, name: str) -> None:
    assert choose_parser("auto", template).name == name
    assert choose_parser("llama3_json", template).name == "llama3_json"
    with pytest.raises(ValueError, match="known: auto, hermes, llama3_json"):
        choose_parser("mistral", template)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat(**fields: object) -> ChatCompletionRequest:
    user = [{"role": "user", "content": "hi"}]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": user, **fields})


def test_tool_choice_plans() -> None:
    assert plan_tools(chat(), HermesParser()).parser is None
    assert plan_tools(chat(tools=TOOLS, tool_choice="none"), HermesParser()).tools is None
    auto = plan_tools(chat(tools=TOOLS), HermesParser())
    assert auto.parser is not None and auto.grammar is None and auto.tools is not None
    get_weather = {"type": "function", "function": {"name": "get_weather"}}
    named = plan_tools(chat(tools=TOOLS, tool_choice=get_weather), HermesParser())
    assert named.grammar is not None and named.grammar.prefix == "<tool_call>\n"
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                {"tool_choice": "required"}):
        with pytest.raises(BadRequest) as raised:
            plan_tools(chat(**bad), HermesParser())
        assert raised.value.param == "tool_choice"


def messages(*items: dict[str, object]) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in items]


CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]}


def test_history_with_calls_renders_for_both_kinds_of_template() -> None:
    history = messages({"role": "user", "content": "weather?"}, CALL,
                       {"role": "tool", "tool_call_id": "call_1", "content": "rain"})
    native = template_messages(history, HermesParser(), True, None)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1", "name": "get_weather"}
    folded = template_messages(history, HermesParser(), False, TOOLS)
    assert folded[0]["role"] == "system" and "get_weather" in folded[0]["content"]
    assert folded[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
                                   "</tool_call>"
    assert folded[3] == {"role": "user", "content": "<tool_response>\nrain\n</tool_response>"}


@pytest.mark.parametrize(("history", "param"), [
    ([{"role": "tool", "tool_call_id": "call_9", "content": "rain"}], "messages[0].tool_call_id"),
    ([CALL, {"role": "tool", "tool_call_id": "call_2", "content": "rain"}], "messages[1].tool_call_id"),
    ([{"role": "tool", "content": "rain"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{**CALL, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_history_is_a_400_naming_the_field(history: list[dict[str, object]], param: str) -> None:
    with pytest.raises(BadRequest) as raised:
        template_messages(messages(*history), HermesParser(), True, None)
    assert raised.value.param == param
