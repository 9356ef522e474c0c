"""Tool-call parsers without a server: each family's output read into calls whole and streamed (the streamed
deltas join into the whole answer, id/type/name before any argument fragment, whatever the cut points; a
stream reads after every delta what a whole scan of the text so far reads, and sends what re-scanning sent);
the parser detected from chat templates; history checks that name the bad field."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.api.tool_parsers import (
    CallSoFar,
    HermesParser,
    Llama3JsonParser,
    Scan,
    ToolCallParser,
    choose_parser,
)
from gateway.api.tool_prompt import plan_tools, template_messages
from gateway.api.tool_responses import ToolCallStream, whole_message
from gateway.api.tool_stream_scan import stream_scanner

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


# What outputs are made of here: JSON's structure, the tags (whole and cut), blanks (Unicode ones too),
# escapes, numbers and literals cut short, prose.
PIECES = ['"name"', '"arguments"', '"parameters"', '"f"', "{", "}", "[", "]", ":", ",", " ", "\n", '"', "\\",
          '\\"', "12", "1.", "-", "true", "tru", "null", "NaN", "x", "<tool_call>", "</tool_call>", "<tool_",
          "</tool", "<|python_tag|>", "<|py", ";", "\t", "\u00a0", "é", "🦊", '"a }"', "{}", "0", "\x01"]
OUTPUTS = [HERMES, LLAMA3, "Just an answer.", "<tool_call>\nnot json\n</tool_call>",
           '<tool_call>\n{"name": "f", "arguments": {"a": "</tool_call>"}}\n</tool_call>',
           ' <|python_tag|> {"name": "f", "parameters": {"a": [1, {"b": "\\"}"}]}}; {"x": 1}', ""]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(parser=st.sampled_from([HermesParser(), Llama3JsonParser()]), output=st.sampled_from(OUTPUTS),
       edits=st.lists(st.tuples(st.integers(0, 400), st.sampled_from(PIECES)), max_size=6),
       cuts=st.lists(st.integers(1, 9), min_size=1, max_size=6))
def test_a_stream_reads_after_every_delta_what_a_whole_scan_of_the_text_so_far_reads(
        parser: ToolCallParser, output: str, edits: list[tuple[int, str]], cuts: list[int]) -> None:
    for at, piece in edits:  # the model writes something else somewhere
        at %= len(output) + 1
        output = output[:at] + piece + output[at:]
    scanner = stream_scanner(parser)
    chunks = cut(output, cuts)
    text = ""
    for i, chunk in enumerate(chunks):
        is_final = i == len(chunks) - 1
        text += chunk
        scanner.feed(chunk, is_final)
        calls = tuple(CallSoFar(c.name, text[c.args_start : c.args_end], c.is_complete)
                      for c in scanner.calls_from(0))
        assert Scan(text[: scanner.content_end], calls) == parser.scan(text, is_final), (text, is_final)


def cut(text: str, sizes: list[int]) -> list[str]:
    chunks, start, i = [], 0, 0
    while start < len(text) or not chunks:
        chunks.append(text[start : start + sizes[i % len(sizes)]])
        start, i = start + sizes[i % len(sizes)], i + 1
    return chunks


def long_call(name: str, args_key: str, num_items: int) -> str:
    return json.dumps({"name": name, args_key: {"items": [{"id": i, "note": 'a "quoted" } ]'} for i in
                                                  range(num_items)], "text": "lorem ipsum \\ " * num_items}})


HERMES_CALLS = "".join(f"<tool_call>\n{long_call(name, 'arguments', 60)}\n</tool_call>\n" for name in "fgh")
LONG_OUTPUTS = {
    "hermes calls": "Let me look.\n\n" + HERMES_CALLS,
    "hermes, then a body that is not a call": HERMES_CALLS + '<tool_call>\n{"name": "g", "arguments": {\n'
                                                             "</tool_call>",
    "llama3 calls": "<|python_tag|>" + "; ".join(long_call(name, "parameters", 60) for name in "abc"),
}


@pytest.mark.parametrize("case", list(LONG_OUTPUTS))
def test_a_long_stream_sends_the_deltas_rescanning_sent(case: str) -> None:
    """The stream scans from where the last delta's scan stopped, not the whole text again (which made a long
    call O(n²)); what it sends is what scanning everything after every delta sent."""
    parser: ToolCallParser = Llama3JsonParser() if case.startswith("llama3") else HermesParser()
    text = LONG_OUTPUTS[case]
    rng = random.Random(0)
    chunks = cut(text, [rng.randint(1, 7) for _ in range(64)])
    stream = ToolCallStream(parser)
    sent = [[_plain(d.model_dump(exclude_none=True)) for d in stream.feed(c, i == len(chunks) - 1)]
            for i, c in enumerate(chunks)]
    assert len(chunks) > 500 and sent == rescanned_deltas(parser, chunks)
    assert stream.finish_reason("stop") == ("stop" if "not a call" in case else "tool_calls")


def _plain(delta: dict[str, Any]) -> dict[str, Any]:
    for piece in delta.get("tool_calls", []):
        if "id" in piece:
            piece["id"] = "call"  # minted at random
    return delta


def rescanned_deltas(parser: ToolCallParser, chunks: list[str]) -> list[list[dict[str, Any]]]:
    """What ToolCallStream sent when it scanned the whole text so far after every delta: what grew."""
    text, num_content, num_args, sent = "", 0, [], []
    for i, chunk in enumerate(chunks):
        text += chunk
        scan = parser.scan(text, is_final=i == len(chunks) - 1)
        deltas: list[dict[str, Any]] = []
        if len(scan.content) > num_content:
            deltas.append({"content": scan.content[num_content:]})
            num_content = len(scan.content)
        pieces: list[dict[str, Any]] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(num_args):
                num_args.append(0)
                pieces.append({"index": index, "id": "call", "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            if len(call.arguments) > num_args[index]:
                pieces.append({"index": index, "function": {"arguments": call.arguments[num_args[index]:]}})
                num_args[index] = len(call.arguments)
        sent.append(deltas + ([{"tool_calls": pieces}] if pieces else []))
    return sent


def test_json_that_python_cannot_decode_is_no_call_not_an_error() -> None:
    # A number of more digits than int() takes raised ValueError from the scan, and nesting past the recursion
    # limit RecursionError: the stream and the whole answer failed.
    for body in ('{"name": "f", "arguments": {"x": ' + "1" * 5000 + "}}",
                 '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"):
        text = f"<tool_call>\n{body}\n</tool_call>"
        message, finish = whole_message(HermesParser(), text, "stop")
        assert (message.content, message.tool_calls, finish) == (text, None, "stop")
        stream = ToolCallStream(HermesParser())
        chunks = cut(text, [50])
        deltas = [d for i, c in enumerate(chunks) for d in stream.feed(c, is_final=i == len(chunks) - 1)]
        assert "".join(d.content or "" for d in deltas) == text  # at the end: the call's name went first


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
