"""A Responses request → the chat request the rest of the path already serves, and its 400s back in the
Responses request's own names.

    instructions            → a system message, first;
    input (string)          → one user message;
    message items           → messages of their role (parts' texts joined);
    function_call items     → an assistant message's tool_calls (call_id as the call's id); calls right
                              after an assistant message (text or calls) join it: one turn, as chat sends it;
    function_call_output    → a tool message answering call_id;
    reasoning items         → the next assistant message's `reasoning` (the turn it opens: the message or
                              calls after it join it), for the chat template to keep or drop;
    tools, tool_choice      → chat's nested shapes; max_output_tokens → max_completion_tokens;
    text.format             → response_format (json_schema: the grammar the chat path compiles).
A check the chat preparation makes (a call_id no call made, arguments that are not JSON, a prompt past the
context) names a chat field; `in_responses_terms` renames it to the item or field the client sent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.api.protocol_tools import (
    FunctionCall,
    FunctionDefinition,
    FunctionName,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from gateway.api.responses_api.protocol import (
    MESSAGE_NOT_SUPPORTED,
    NOT_SUPPORTED,
    TEXT_NOT_SUPPORTED,
    FunctionCallInput,
    FunctionCallOutputInput,
    InputMessage,
    ReasoningInput,
    ResponsesRequest,
    joined,
)
from gateway.api.surface import check_fields

# Chat fields whose Responses names differ.
_RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
            "response_format": "text.format", "messages": "input"}
_MESSAGE_PARAM = re.compile(r"messages\[(\d+)\](?:\.tool_calls\[(\d+)\])?(?:\.([\w.]+))?")
# Sub-fields of a message whose names differ on the item it came from.
_ITEM_FIELDS = {"tool_call_id": "call_id", "content": "content"}


@dataclass
class Origin:
    """Where a chat message came from: the item (or `instructions`) and, for its tool calls, theirs."""

    path: str  # "instructions" or "input[i]"
    call_paths: list[str] = field(default_factory=list)  # "input[j]" of each of its tool_calls


@dataclass(frozen=True)
class ChatForm:
    request: ChatCompletionRequest
    origins: list[Origin]  # one per message of `request`


def check_supported(body: ResponsesRequest) -> None:
    """Raise BadRequest naming the first field, at any depth, that asks for what pdserve does not do."""
    check_fields(body.model_extra, known=NOT_SUPPORTED)
    for i, item in enumerate(body.input if isinstance(body.input, list) else []):
        where = f"input[{i}]."
        check_fields(item.model_extra, where, MESSAGE_NOT_SUPPORTED if isinstance(item, InputMessage) else {})
        parts: list[Any] = []
        if isinstance(item, InputMessage) and isinstance(item.content, list):
            parts = item.content
        elif isinstance(item, FunctionCallOutputInput) and isinstance(item.output, list):
            parts = item.output
        elif isinstance(item, ReasoningInput):
            parts = item.content or []
        field_name = "output" if isinstance(item, FunctionCallOutputInput) else "content"
        for j, part in enumerate(parts):
            check_fields(part.model_extra, f"{where}{field_name}[{j}].", {})
    for i, tool in enumerate(body.tools or []):
        check_fields(tool.model_extra, f"tools[{i}].", {})
    if body.tool_choice is not None and not isinstance(body.tool_choice, str):
        check_fields(body.tool_choice.model_extra, "tool_choice.", {})
    if body.text is not None:
        check_fields(body.text.model_extra, "text.", TEXT_NOT_SUPPORTED)
        if body.text.format is not None:
            check_fields(body.text.format.model_extra, "text.format.", {})


def to_chat(body: ResponsesRequest, model_name: str) -> ChatForm:
    """The chat request that serves `body` (checked with check_supported first)."""
    messages: list[ChatMessage] = []
    origins: list[Origin] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
        origins.append(Origin("instructions"))
    thinking: ChatMessage | None = None  # an assistant turn opened by a reasoning item, no answer yet
    for i, item in enumerate(body.items):
        path = f"input[{i}]"
        if isinstance(item, ReasoningInput):
            thinking = ChatMessage(role="assistant", content="", reasoning=item.text)
            messages.append(thinking)
            origins.append(Origin(path))
            continue
        if isinstance(item, InputMessage) and item.role == "assistant" and thinking is not None:
            thinking.content = joined(item.content)  # the answer of the turn its reasoning opened
            origins[-1].path = path
        elif isinstance(item, InputMessage):
            messages.append(ChatMessage(role=item.role, content=joined(item.content)))
            origins.append(Origin(path))
        elif isinstance(item, FunctionCallInput):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # the same assistant turn: one message
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
                origins.append(Origin(path))
            origins[-1].call_paths.append(path)
        else:
            messages.append(ChatMessage(role="tool", content=joined(item.output), tool_call_id=item.call_id))
            origins.append(Origin(path))
        thinking = None
    fields: dict[str, Any] = {
        "model": body.model or model_name, "messages": messages, "stream": bool(body.stream),
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "tools": [Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
            for t in body.tools] if body.tools else None,
        "tool_choice": (NamedToolChoice(type="function", function=FunctionName(name=body.tool_choice.name))
                        if body.tool_choice is not None and not isinstance(body.tool_choice, str)
                        else body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "cache_salt": body.cache_salt,
    }
    # Unset fields keep the chat request's own defaults (one place for each).
    try:
        request = ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as error:  # the Responses models check the same bounds: not expected
        raise BadRequest(f"the request cannot be served as a chat request: {error.errors()[0]['msg']}"
                         ) from None
    return ChatForm(request, origins)


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.json_schema is None:
        raise BadRequest("text.format.schema: type json_schema needs a schema", param="text.format.schema")
    schema = JsonSchemaFormat.model_validate({"name": fmt.name or "response", "description": fmt.description,
                                              "schema": fmt.json_schema, "strict": fmt.strict})
    return ResponseFormat(type="json_schema", json_schema=schema)


def in_responses_terms(error: BadRequest, origins: list[Origin]) -> BadRequest:
    """The chat path's BadRequest, its param (and the message's leading param) renamed for the client."""
    param = error.param
    if param is None:
        return error
    renamed = _RENAMED.get(param)
    matched = _MESSAGE_PARAM.fullmatch(param)
    if matched is not None and int(matched[1]) < len(origins):
        origin = origins[int(matched[1])]
        sub = matched[3]
        if matched[2] is not None and int(matched[2]) < len(origin.call_paths):
            renamed = f"{origin.call_paths[int(matched[2])]}.arguments"  # the only call field checked
        elif origin.path == "instructions":
            renamed = "instructions"
        else:
            renamed = f"{origin.path}.{_ITEM_FIELDS.get(sub, sub)}" if sub else origin.path
    if renamed is None:
        return error
    message = str(error)
    message = f"{renamed}{message[len(param):]}" if message.startswith(param) else message
    if error.code == "context_length_exceeded":  # vLLM's sentence names the chat field
        message = message.replace("the messages", "the input").replace("max_tokens", "max_output_tokens")
    return BadRequest(message, status=error.status, param=renamed, code=error.code)
