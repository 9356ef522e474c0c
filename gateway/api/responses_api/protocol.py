"""The Responses API request (OpenAI's `POST /v1/responses`, text only), validated once, at the edge.

Shapes follow openai-python's `types/responses/` (ResponseCreateParams): `input` is a string or a list of
items (messages, function calls and their outputs, earlier reasoning); tools are flat function definitions;
tool_choice names a function as `{"type": "function", "name": ...}`; `text.format` asks for JSON. Types are
strict, as the chat models are. Undeclared fields are kept (`extra="allow"`) so that `NOT_SUPPORTED` and
gateway/api/surface.py's check name every one that would otherwise change nothing in silence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from gateway.api.protocol import MAX_MESSAGES, Text
from gateway.api.protocol_extensions import MAX_CACHE_SALT_CHARS
from gateway.api.protocol_tools import MAX_TOOLS

MAX_PARTS = 256  # text parts of one message: each is joined into the message's text

_STATELESS = ("pdserve keeps no responses or conversations (store: false): send the whole conversation "
              "in `input`")


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Field → (does this value ask for nothing?, what a client should know); anything else undeclared is unknown.
NOT_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "store": (lambda v: v is None or v is False, _STATELESS),
    "previous_response_id": (lambda v: v is None, _STATELESS),
    "conversation": (lambda v: v is None, _STATELESS),
    "background": (_absent, "background responses need server-side state; " + _STATELESS),
    "background_options": (_absent, "background responses need server-side state; " + _STATELESS),
    "prompt": (lambda v: v is None, "stored prompt templates are not supported; send the text in `input`"),
    "include": (_absent, "no extra output data (sources, logprobs, encrypted reasoning) is available"),
    "reasoning": (_absent, "reasoning options are not supported"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls is not supported"),
    "top_logprobs": (lambda v: v is None or v == 0, "logprobs are not supported on /v1/responses"),
    "truncation": (lambda v: v is None or v == "disabled", "only truncation \"disabled\" is supported: a "
                   "conversation longer than the context is a 400"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "there is one service tier"),
    "stream_options": (lambda v: v is None or v == {} or v == {"include_obfuscation": False},
                       "stream obfuscation is not supported"),
    "context_management": (_absent, "context management (compaction) is not supported"),
    "prompt_cache_retention": (lambda v: v is None, "the prefix cache is automatic and not configurable"),
    "prompt_cache_options": (_absent, "the prefix cache is automatic and not configurable"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
    "image": (_absent, "only text is supported"),
    "access_programs": (_absent, "access programs are not supported"),
}
# On an input message: `phase` marks an output of OpenAI's own agent models.
MESSAGE_NOT_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "phase": (lambda v: v is None, "message phases are not supported"),
}
# On `text`: verbosity is a knob of OpenAI's reasoning models.
TEXT_NOT_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "verbosity": (lambda v: v is None, "verbosity is not supported"),
}


def _tagged_by_type(default: str | None) -> Callable[[Any], str | None]:
    """A union's tag: `type=<the item's type>` (`default` when it names none, as a plain message may).
    A tag is part of a validation error's location: spelled so, it is never taken for a field's name."""
    def tag(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", None)
        return f"type={kind}" if isinstance(kind, str) else None
    return tag


class _Item(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class InputTextPart(_Item):
    type: Literal["input_text"]
    text: Text


class OutputTextPart(_Item):
    """An earlier answer's text, as a client sends the previous output back."""

    type: Literal["output_text"]
    text: Text
    # Ignored by design: they describe an earlier answer and change nothing in the next one.
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


TextPart = Annotated[
    Annotated[InputTextPart, Tag("type=input_text")] | Annotated[OutputTextPart, Tag("type=output_text")],
    Discriminator(_tagged_by_type(None), custom_error_type="unsupported_part",
                  custom_error_message="only input_text and output_text parts are supported (text only)")]
TextParts = Annotated[list[TextPart], Field(max_length=MAX_PARTS)]


def joined(content: str | Sequence[InputTextPart | OutputTextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Item):
    """A message: OpenAI's EasyInputMessage (no `type` needed), an input message, or an earlier output one."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | TextParts
    # Ignored by design: an earlier output item's id and status (the client sends the output back as is).
    id: str | None = None
    status: str | None = None


class FunctionCallInput(_Item):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)  # what the function_call_output that answers it names
    name: str = Field(min_length=1)
    arguments: str  # the arguments object as JSON text
    id: str | None = None  # ignored by design, as a message's
    status: str | None = None


class FunctionCallOutputInput(_Item):
    """The client's result of an earlier call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Text | Annotated[list[InputTextPart], Field(max_length=MAX_PARTS)]
    id: str | None = None  # ignored by design, as a message's
    status: str | None = None


class ReasoningTextPart(_Item):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningInput(_Item):
    """An earlier answer's thinking (a reasoning output item sent back, as the openai-agents SDK does): the
    assistant turn's `reasoning`, for the chat template to keep or drop (Qwen3's keeps the last turn's)."""

    type: Literal["reasoning"]
    content: Annotated[list[ReasoningTextPart], Field(max_length=MAX_PARTS)] | None = None
    # Ignored by design: the item's id and status, and an empty summary (pdserve writes none).
    id: str | None = None
    status: str | None = None
    summary: list[Any] | None = None
    encrypted_content: None = None  # pdserve never writes it, so a client has none of ours to send

    @property
    def text(self) -> str:
        return "".join(part.text for part in self.content or [])


InputItem = Annotated[
    Annotated[InputMessage, Tag("type=message")] | Annotated[FunctionCallInput, Tag("type=function_call")]
    | Annotated[FunctionCallOutputInput, Tag("type=function_call_output")]
    | Annotated[ReasoningInput, Tag("type=reasoning")],
    Discriminator(_tagged_by_type("message"), custom_error_type="unsupported_item",
                  custom_error_message="only items of type message, function_call, function_call_output and "
                                       "reasoning are supported (text only; no items stored on the server)")]


class FunctionToolParam(_Item):
    """A function the model may call (flat: no nested `function` object, unlike chat's tools)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


ToolParam = Annotated[
    Annotated[FunctionToolParam, Tag("type=function")],
    Discriminator(_tagged_by_type(None), custom_error_type="unsupported_tool",
                  custom_error_message="only tools of type function are supported (no hosted tools)")]


class FunctionChoice(_Item):
    """`tool_choice: {"type": "function", "name": ...}`: call exactly this function."""

    type: Literal["function"]
    name: str


class TextFormat(_Item):
    """`text.format`: plain text, any JSON object, or a document valid against `schema`."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)  # json_schema's name (required by OpenAI)
    description: str | None = None
    # `schema` would shadow BaseModel.schema(): the attribute is json_schema, the JSON key `schema`.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    format: TextFormat | None = None


class ResponsesRequest(_Item):
    model: str | None = None  # None: the served model
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None  # a system message before `input`
    max_output_tokens: int | None = Field(default=None, ge=1)  # None: the context left, up to a default
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool | None = None  # accepted; a forced call (required / named) is one call
    text: TextConfig | None = None
    stream: bool | None = False
    # Accepted and ignored by design: they change nothing in what the model generates.
    metadata: dict[str, str] | None = None  # the caller's tags, echoed back on the response
    user: str | None = None  # an end-user id for the caller's abuse monitoring
    safety_identifier: str | None = None  # the same, by its newer name
    prompt_cache_key: str | None = None  # a caching hint: pdserve's prefix cache matches by content anyway
    # vLLM's: the request's prefix-cache partition (gateway/api/protocol_extensions.py).
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)

    @field_validator("max_output_tokens", mode="before")
    @classmethod
    def _whole_number(cls, value: object) -> object:
        # JSON has one number type: 4.0 is an integer to JSON Schema (and what some clients send for 4).
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @property
    def items(self) -> list[InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput]:
        """`input` as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input)


# Every model of the request: the error handler keeps their field names in a 400's `param`.
REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ResponsesRequest, InputMessage, FunctionCallInput, FunctionCallOutputInput, ReasoningInput, InputTextPart,
    OutputTextPart, ReasoningTextPart, FunctionToolParam, FunctionChoice, TextConfig, TextFormat)
