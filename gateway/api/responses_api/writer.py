"""One response's output, written as the chat path's TextDeltas arrive: its items and the events that say so.

    start()        → response.created, response.in_progress;
    feed(delta)    → with --reasoning-parser, the thinking first (split off by the chat path's
                     ReasoningStream): a reasoning item opens (output_item.added), then reasoning_text.delta
                     per fragment; text: a message item opens (output_item.added, content_part.added), then
                     output_text.delta per fragment; a tool call (read by the chat path's ToolCallStream with
                     the model's parser, when tools are on): the open item closes, a function_call item opens
                     (output_item.added), then function_call_arguments.delta per fragment; the last delta
                     closes the open item (output_text.done, content_part.done / function_call_arguments.done
                     / reasoning_text.done, then output_item.done) and ends the response: response.completed,
                     or response.incomplete (incomplete_details: max_output_tokens) when max_output_tokens
                     cut it;
    fail(...)      → error, response.failed: a stream that cannot finish ends with a reason.
A whole (not streamed) response runs the same writer and drops the events, so both read the same items from
the same text. Pure Python: tests/gateway/test_responses_api.py drives it with hand-made deltas.
"""

from __future__ import annotations

import time
import uuid
from typing import cast

from gateway.api.protocol import ChatDelta
from gateway.api.protocol_tools import ToolCallDelta
from gateway.api.reasoning import ReasoningStream
from gateway.api.responses_api.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    ErrorEvent,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningDeltaEvent,
    ReasoningDoneEvent,
    ReasoningItem,
    ReasoningText,
    ResponseError,
    ResponseEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from gateway.api.tool_parsers import ToolCallParser
from gateway.api.tool_responses import ToolCallStream
from gateway.requests.prepared import TextDelta


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseWriter:
    """Items and events of one response; `response` is the whole object once the last delta was fed."""

    def __init__(self, response: ResponseObject, num_prompt_tokens: int, parser: ToolCallParser | None,
                 thoughts: ReasoningStream | None = None) -> None:
        """Args:
            parser: reads tool calls out of the answer (tools on), else None.
            thoughts: splits the thinking off the answer (--reasoning-parser), else None.
        """
        self.response = response  # in progress until the last delta
        self.num_prompt_tokens = num_prompt_tokens
        self.tools = ToolCallStream(parser) if parser is not None else None
        self.thoughts = thoughts
        self.num_reasoning_tokens = 0  # tokens generated while the model was still reasoning
        self.num_events = 0  # the next event's sequence_number
        # The item being written.
        self.open_item: OutputMessage | FunctionCallItem | ReasoningItem | None = None
        self.output_index_of_call: dict[int, int] = {}  # the chat stream's call index → output_index

    def start(self) -> list[ResponseEvent]:
        return [self._lifecycle("response.created"), self._lifecycle("response.in_progress")]

    def feed(self, delta: TextDelta) -> list[ResponseEvent]:
        is_final = delta.finish_reason is not None
        events: list[ResponseEvent] = []
        text = delta.text
        if self.thoughts is not None:
            thought, text = self.thoughts.feed(delta.text, is_final)
            if thought:  # written before this delta's answer text
                events += self._reasoning(thought)
            if self.thoughts.is_reasoning:  # this delta's tokens were all thinking
                self.num_reasoning_tokens = delta.num_output_tokens
        if self.tools is not None:
            pieces = self.tools.feed(text, is_final)
        else:
            pieces = [ChatDelta(content=text)] if text else []
        for piece in pieces:
            if piece.content:
                events += self._text(piece.content)
            # A stream's pieces carry ToolCallDeltas (whole ToolCalls are a whole chat message's).
            for call in cast(list[ToolCallDelta], piece.tool_calls or []):
                arguments = call.function.arguments or ""
                if call.id is not None:  # a call's first piece: id and name
                    events += self._open_call(call.index, call.id, call.function.name or "")
                if arguments:
                    events += self._arguments(call.index, arguments)
        if is_final:
            events += self._finish(delta)
        return events

    def fail(self, message: str, code: str) -> list[ResponseEvent]:
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        error = ErrorEvent(sequence_number=self._next(), code=code, message=message)
        return [error, self._lifecycle("response.failed")]

    def _text(self, text: str) -> list[ResponseEvent]:
        events = [] if isinstance(self.open_item, OutputMessage) else self._open_message()
        message = self.open_item
        assert isinstance(message, OutputMessage)
        message.content[0].text += text
        events.append(TextDeltaEvent(sequence_number=self._next(), item_id=message.id,
                                     output_index=self._open_index, content_index=0, delta=text))
        return events

    def _reasoning(self, text: str) -> list[ResponseEvent]:
        events: list[ResponseEvent] = []
        if not isinstance(self.open_item, ReasoningItem):
            events += self._close("completed")
            events.append(self._add(ReasoningItem(id=_item_id("rs"), content=[ReasoningText(text="")],
                                                  status="in_progress")))
        item = self.open_item
        assert isinstance(item, ReasoningItem)
        item.content[0].text += text
        events.append(ReasoningDeltaEvent(sequence_number=self._next(), item_id=item.id,
                                          output_index=self._open_index, content_index=0, delta=text))
        return events

    def _open_message(self) -> list[ResponseEvent]:
        events = self._close("completed")
        message = OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
        events.append(self._add(message))
        part = OutputText(text="")
        message.content.append(part)
        events.append(ContentPartEvent(type="response.content_part.added", sequence_number=self._next(),
                                       item_id=message.id, output_index=self._open_index, content_index=0,
                                       part=part.model_copy()))
        return events

    def _open_call(self, index: int, call_id: str, name: str) -> list[ResponseEvent]:
        events = self._close("completed")
        events.append(self._add(FunctionCallItem(id=_item_id("fc"), call_id=call_id, name=name, arguments="",
                                                 status="in_progress")))
        self.output_index_of_call[index] = self._open_index
        return events

    def _arguments(self, index: int, fragment: str) -> list[ResponseEvent]:
        output_index = self.output_index_of_call[index]
        # ToolCallStream finishes a call's arguments before it opens the next: this is the open item.
        call = cast(FunctionCallItem, self.response.output[output_index])
        call.arguments += fragment
        return [ArgumentsDeltaEvent(sequence_number=self._next(), item_id=call.id, output_index=output_index,
                                    delta=fragment)]

    def _add(self, item: OutputMessage | FunctionCallItem | ReasoningItem) -> ResponseEvent:
        self.response.output.append(item)
        self.open_item = item
        return OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                               output_index=self._open_index, item=item.model_copy(deep=True))

    def _close(self, status: str) -> list[ResponseEvent]:
        """The open item's done events, the item marked `status`."""
        item, self.open_item = self.open_item, None
        if item is None:
            return []
        index = len(self.response.output) - 1  # the open item is always the last one
        events: list[ResponseEvent] = []
        item.status = status  # type: ignore[assignment]
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(TextDoneEvent(sequence_number=self._next(), item_id=item.id, output_index=index,
                                        content_index=0, text=part.text))
            events.append(ContentPartEvent(type="response.content_part.done", sequence_number=self._next(),
                                           item_id=item.id, output_index=index, content_index=0,
                                           part=part.model_copy()))
        elif isinstance(item, ReasoningItem):
            events.append(ReasoningDoneEvent(sequence_number=self._next(), item_id=item.id,
                                             output_index=index, content_index=0, text=item.content[0].text))
        else:
            events.append(ArgumentsDoneEvent(sequence_number=self._next(), item_id=item.id,
                                             output_index=index, name=item.name, arguments=item.arguments))
        events.append(OutputItemEvent(type="response.output_item.done", sequence_number=self._next(),
                                      output_index=index, item=item.model_copy(deep=True)))
        return events

    def _finish(self, last: TextDelta) -> list[ResponseEvent]:
        is_cut = last.finish_reason == "length"
        events: list[ResponseEvent] = []
        if not any(isinstance(item, (OutputMessage, FunctionCallItem)) for item in self.response.output):
            events += self._open_message()  # no answer written: an empty message, as a whole response has one
        events += self._close("incomplete" if is_cut else "completed")
        response = self.response
        response.status = "incomplete" if is_cut else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if is_cut else None
        response.completed_at = int(time.time())
        response.usage = ResponseUsage(
            input_tokens=self.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=last.num_cached_tokens),
            output_tokens=last.num_output_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.num_reasoning_tokens),
            total_tokens=self.num_prompt_tokens + last.num_output_tokens)
        response.timings = last.timings
        events.append(self._lifecycle("response.incomplete" if is_cut else "response.completed"))
        return events

    @property
    def _open_index(self) -> int:
        return len(self.response.output) - 1  # the open item is always the last one

    def _lifecycle(self, kind: str) -> ResponseEvent:
        return ResponseLifecycleEvent(type=kind, sequence_number=self._next(),  # type: ignore[arg-type]
                                      response=self.response.model_copy(deep=True))

    def _next(self) -> int:
        self.num_events += 1
        return self.num_events - 1
