"""A chat request's tools, tool_choice and tool-calling history → what the chat template renders, the grammar
that forces a call, and whether the output is read for calls.

    tool_choice  none      → tools are not shown to the model, the output is plain content;
                 auto      → tools shown (the default when tools are given), calls read from the output;
                 required  → one call to one of the tools, forced by a grammar in the parser's format;
                 named     → one call to that function, forced the same way.
History: an assistant message may carry `tool_calls` (content null), a `tool` message answers one of them by
`tool_call_id`; one that answers no earlier call is a 400 naming it. A template that knows tools gets them as
transformers passes them (`tools=`, calls with their arguments as objects); one that does not (SmolLM2's) gets
the tools described in the system message, earlier calls written in the parser's format and tool results as
user turns, so the same requests work on every model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.api.structured import checked_grammar
from gateway.api.tool_parsers import ToolCallParser
from llm_engine.structured import GrammarSpec


@dataclass(frozen=True)
class ToolPlan:
    parser: ToolCallParser | None  # read calls from the output (tools given, tool_choice not none)
    grammar: GrammarSpec | None  # a forced call (required or named)
    tools: list[dict[str, Any]] | None  # the tools as the template's `tools=` takes them; None: none shown


def plan_tools(request: ChatCompletionRequest, parser: ToolCallParser) -> ToolPlan:
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise BadRequest("tool_choice: needs tools to choose from", param="tool_choice")
    if choice == "none":
        return ToolPlan(None, None, None)
    shown = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "auto":
        return ToolPlan(parser, None, shown)
    if choice == "required":
        forced = tools
    else:
        forced = [t for t in tools if t.function.name == choice.function.name]
        if not forced:
            known = ", ".join(t.function.name for t in tools)
            raise BadRequest(f"tool_choice: no function named {choice.function.name!r} in tools ({known})",
                             param="tool_choice")
    return ToolPlan(parser, checked_grammar(parser.call_grammar(forced), "tools"), shown)


def template_messages(messages: list[ChatMessage], parser: ToolCallParser, template_knows_tools: bool,
                      tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it. Raises BadRequest naming a bad message field."""
    rendered: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id → function name, of the calls made so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise BadRequest(f"{where}.content: only an assistant message with tool_calls may have none",
                             param=f"{where}.content")
        if message.tool_calls and message.role != "assistant":
            raise BadRequest(f"{where}.tool_calls: only assistant messages make tool calls",
                             param=f"{where}.tool_calls")
        if message.role == "tool":
            rendered.append(_tool_result(message, where, call_names, template_knows_tools))
            continue
        entry: dict[str, Any] = {"role": message.role, "content": message.text}
        thinking = message.reasoning if message.reasoning is not None else message.reasoning_content
        if thinking is not None and message.role == "assistant":
            entry["reasoning"] = entry["reasoning_content"] = thinking
        if message.tool_calls:
            calls = []
            for j, call in enumerate(message.tool_calls):
                call_names[call.id] = call.function.name
                calls.append((call, _arguments(call.function.arguments, f"{where}.tool_calls[{j}]")))
            if template_knows_tools:
                entry["tool_calls"] = [{"id": c.id, "type": "function",
                                        "function": {"name": c.function.name, "arguments": args}}
                                       for c, args in calls]
            else:
                written = "\n".join(parser.history_text(c.function.name, args) for c, args in calls)
                entry["content"] = f"{message.text}\n{written}" if message.text else written
        rendered.append(entry)
    if tools and not template_knows_tools:
        rendered = _with_tools_described(rendered, tools, parser)
    return rendered


def _arguments(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise BadRequest(f"{where}.function.arguments: not valid JSON", param=f"{where}.function.arguments"
                         ) from None


def _tool_result(message: ChatMessage, where: str, call_names: dict[str, str], template_knows_tools: bool
                 ) -> dict[str, Any]:
    if message.tool_call_id is None:
        raise BadRequest(f"{where}.tool_call_id: a tool message must name the call it answers",
                         param=f"{where}.tool_call_id")
    name = call_names.get(message.tool_call_id)
    if name is None:
        raise BadRequest(f"{where}.tool_call_id: no earlier assistant message made a call with id "
                         f"{message.tool_call_id!r}", param=f"{where}.tool_call_id")
    if template_knows_tools:
        return {"role": "tool", "content": message.text, "tool_call_id": message.tool_call_id, "name": name}
    return {"role": "user", "content": f"<tool_response>\n{message.text}\n</tool_response>"}


def _with_tools_described(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                          parser: ToolCallParser) -> list[dict[str, Any]]:
    """The tools and the call format, told in the system message (added when there is none)."""
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = parser.history_text("<function name>", "<arguments as a JSON object>")
    described = ("# Tools\n\nThese functions can be called to help answer. Their signatures:\n"
                 f"<tools>\n{signatures}\n</tools>\n\nTo call one, answer with exactly:\n{example}")
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]


