"""The HTTP edge's models for structured outputs and tool calls (OpenAI's shapes): `response_format`, `tools`,
`tool_choice`, the tool calls of an assistant message, and the tool-call deltas of a stream."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOOLS = 128  # OpenAI's limit on functions per request


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # `schema` would shadow BaseModel.schema(): the attribute is json_schema, the JSON key `schema`.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # True: only the properties the schema names (None means False, as OpenAI)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # with type json_schema


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call exactly this function."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str  # the arguments object as JSON text (as the model wrote it)


class ToolCall(BaseModel):
    """A call in an assistant message: in the history a client sends back, and in a whole response."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in the call's first delta only
    arguments: str | None = None  # a fragment of the arguments' JSON text ("" in the first delta)


class ToolCallDelta(BaseModel):
    """A stream's piece of one call: id, type and name first, then fragments of the arguments."""

    index: int  # which call of the message (0, 1, ... in the order they were made)
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


ToolList = list[Tool]
TOOLS_FIELD = Field(default=None, max_length=MAX_TOOLS)
