"""How each chat-template family writes a tool call, both ways: reading the model's output into calls, and the
grammar (for `tool_choice` required or a named function) and history text in the same format.

    hermes       Qwen2/2.5, Hermes, ChatML models:
                 `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call; any text
                 before the first call is the message's content;
    llama3_json  Llama 3.1+: the whole output is `{"name": ..., "parameters": {...}}` (`;`-separated when
                 several, optionally after `<|python_tag|>`); anything else is content.
A parser's `scan(text, is_final)` reads the output so far and says what is known: the content that can be
shown (text that might still become a call's opening is held back until it is decided) and each call's name
and arguments text once written. A whole response scans once. A stream is read by
gateway/api/tool_stream_scan.py, which resumes after each delta and says what scan() says of the text so
far; gateway/api/tool_responses.py sends what is new. Both read the same calls from the same text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.api.call_reader import NOT_JSON
from gateway.api.protocol_tools import Tool
from llm_engine.structured import GrammarSpec

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


@dataclass(frozen=True)
class CallSoFar:
    name: str | None  # None until the name's string is closed
    arguments: str  # the arguments' JSON text written so far (complete once `is_complete`)
    is_complete: bool  # the call's whole object is closed and valid


@dataclass(frozen=True)
class Scan:
    content: str  # the message's text that is surely not part of a call
    calls: tuple[CallSoFar, ...]


def scan_call_object(text: str, args_keys: tuple[str, ...]) -> CallSoFar | None:
    """Walk the top level of a JSON object that starts `text` (after blanks) as far as it is written.
    None: `text` is not (the beginning of) such an object.

    Not a partial-JSON library (jiter's partial_mode, partial-json-parser): they return the value so far,
    closed, while a stream sends the arguments as the model wrote them, appended to only. Their value, written
    out again, is not a prefix of the next one (`{"a": 12}` then `{"a": 123}`), and they give no offsets for
    the stream's resumed scan (gateway/api/tool_stream_scan.py) to read on from."""
    pos = _SPACE.match(text).end()  # type: ignore[union-attr]
    if pos == len(text):
        return CallSoFar(None, "", False)
    if text[pos] != "{":
        return None
    pos += 1
    name: str | None = None
    arguments = ""
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos < len(text) and text[pos] == "}":
            return CallSoFar(name, arguments, name is not None)
        if pos < len(text) and text[pos] == ",":
            pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
        try:
            key, pos = _DECODER.raw_decode(text, pos)
        except NOT_JSON:
            return CallSoFar(name, arguments, False)
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= len(text) or text[pos] != ":":
            return CallSoFar(name, arguments, False)
        pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except NOT_JSON:
            # A value still being written: an object's or array's text so far is the arguments' prefix.
            if key in args_keys and pos < len(text) and text[pos] in "{[":
                arguments = text[pos:].rstrip()
            return CallSoFar(name, arguments, False)
        if key == "name" and isinstance(value, str):
            name = value
        elif key in args_keys:
            arguments = text[pos:end]
        pos = end


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`."""
    if marker[0] not in text[1 - len(marker) :]:
        return 0
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallParser:
    name = ""
    args_key = "arguments"  # the key the template family writes arguments under

    def scan(self, text: str, is_final: bool) -> Scan:
        raise NotImplementedError

    def call_grammar(self, tools: list[Tool]) -> GrammarSpec:
        """One call to one of `tools`, in this family's format (tool_choice required, or a named function)."""
        variants = [{"type": "object", "additionalProperties": False, "required": ["name", self.args_key],
                     "properties": {"name": {"const": t.function.name}, self.args_key: arguments_schema(t)}}
                    for t in tools]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        return self._wrap(schema)

    def _wrap(self, schema: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec.of_schema(schema)

    def history_text(self, name: str, arguments: Any) -> str:
        """An earlier call as the model would have written it (for templates that know no tool calls)."""
        return json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)


def arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def scan(self, text: str, is_final: bool) -> Scan:
        start = text.find(self.OPEN)
        if start < 0:
            if is_final:
                return Scan(text, ())
            # Newlines before a call are not content: held back too until something else follows.
            return Scan(text[: len(text) - held_back(text, self.OPEN)].rstrip("\n"), ())
        calls: list[CallSoFar] = []
        pos = start
        while pos >= 0:
            body_start = pos + len(self.OPEN)
            end = text.find(self.CLOSE, body_start)
            body = text[body_start:] if end < 0 else text[body_start:end]
            call = scan_call_object(body, (self.args_key,))
            if call is None or (end >= 0 and not call.is_complete):
                # Not a call after all (the model wrote the tag in prose): the whole output is content.
                return Scan(text, ()) if is_final else Scan(text[:start], tuple(calls))
            calls.append(call)
            pos = -1 if end < 0 else text.find(self.OPEN, end)
        if is_final and not all(c.is_complete for c in calls):
            return Scan(text, ())
        return Scan(text[:start].rstrip("\n"), tuple(calls))

    def _wrap(self, schema: dict[str, Any]) -> GrammarSpec:
        return GrammarSpec.of_schema(schema, prefix=self.OPEN + "\n", suffix="\n" + self.CLOSE)

    def history_text(self, name: str, arguments: Any) -> str:
        return f"{self.OPEN}\n{super().history_text(name, arguments)}\n{self.CLOSE}"


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    args_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def scan(self, text: str, is_final: bool) -> Scan:
        body = text.lstrip()
        body = body.removeprefix(self.PYTHON_TAG)
        if not body.strip():
            return Scan(text if is_final else "", ())
        if not body.lstrip().startswith("{"):
            return Scan(text, ())
        calls: list[CallSoFar] = []
        for piece in _split_objects(body):
            call = scan_call_object(piece, (self.args_key, "arguments"))
            if call is None:
                return Scan(text, ()) if is_final else Scan("", tuple(calls))
            calls.append(call)
        if is_final and not (calls and all(c.is_complete for c in calls)):
            return Scan(text, ())
        return Scan("", tuple(calls))


def _split_objects(text: str) -> list[str]:
    """`{...}; {...}` → the objects' texts (the last one possibly unfinished)."""
    pieces = []
    pos = 0
    while True:
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        try:
            _, end = _DECODER.raw_decode(text, pos)
        except NOT_JSON:
            pieces.append(text[pos:])
            return pieces
        pieces.append(text[pos:end])
        pos = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if pos < len(text) and text[pos] == ";":
            pos += 1
        if pos >= len(text):
            return pieces


PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}


def choose_parser(name: str, chat_template: str | None) -> ToolCallParser:
    """The parser `--tool-call-parser` names, or ("auto") the one the chat template's text points to.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name == "auto":
        template = chat_template or ""
        is_llama3 = "<|python_tag|>" in template or (
            "<|eot_id|>" in template and "<tool_call>" not in template)
        name = "llama3_json" if is_llama3 else "hermes"  # hermes also for ChatML templates without tools
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: auto, {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
