"""What /v1/responses answers: the response object, its output items, and the typed events of a stream.

Shapes follow openai-python's `types/responses/` (Response, ResponseOutputMessage, ResponseFunctionToolCall,
ResponseUsage, Response*Event), so that the SDK's `client.responses.create` parses them into its own types.
Every event carries `sequence_number` (0, 1, ... per stream) and is sent as `event: <type>` + `data: <JSON>`.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from gateway.telemetry.timings import Timings

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)  # always empty: no citations here
    logprobs: list[Any] = Field(default_factory=list)  # always empty: not offered on this route


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str  # msg_...
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str  # fc_...: the item's id
    call_id: str  # call_...: what the client's function_call_output names
    name: str
    arguments: str  # the arguments object as JSON text (as the model wrote it)
    status: ItemStatus


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(BaseModel):
    """The model's thinking, split off by --reasoning-parser (openai-python's ResponseReasoningItem)."""

    type: Literal["reasoning"] = "reasoning"
    id: str  # rs_...
    summary: list[Any] = Field(default_factory=list)  # always empty: no summarizer here
    content: list[ReasoningText]
    encrypted_content: None = None  # never: the text is given as is
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # tokens written while reasoning (--reasoning-parser), else 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """The response: in `response.created` (in progress, no output), and whole at the end."""

    id: str  # the request id (X-Request-Id and the workers' logs name it too)
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # The request's settings, echoed as OpenAI does (the values applied, defaults filled in).
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float  # as the sampler applies it (0.0: greedy)
    top_p: float
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool = True
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    store: Literal[False] = False
    previous_response_id: None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    timings: Timings | None = None  # pdserve's stage timings (as on chat), when the response finished


class _Event(BaseModel):
    sequence_number: int


class ResponseLifecycleEvent(_Event):
    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete",
                  "response.failed"]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ReasoningDeltaEvent(_Event):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningDoneEvent(_Event):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    item_id: str
    output_index: int
    content_index: int
    text: str


class ErrorEvent(_Event):
    """A stream that fails after it started: this, then `response.failed` (never a silent cut)."""

    type: Literal["error"] = "error"
    code: str
    message: str
    param: str | None = None


ResponseEvent = (ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                 | ArgumentsDeltaEvent | ArgumentsDoneEvent | ReasoningDeltaEvent | ReasoningDoneEvent
                 | ErrorEvent)


def sse(event: ResponseEvent) -> str:
    """The event as OpenAI sends it: its type as the SSE event name, its JSON as the data."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
