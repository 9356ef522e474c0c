"""A chat answer read for tool calls, framed as OpenAI frames them.

Whole: the message's `content` (None when only calls were made) and its `tool_calls` (each with a minted
`call_...` id and the arguments' JSON text), finish_reason "tool_calls" when the model stopped after calls.
Streamed: after each text delta the parser scans the output so far (gateway/api/tool_parsers.py) and
ToolCallStream sends only what is new: content text, then per call first `{index, id, type, function: {name,
arguments: ""}}`, then `{index, function: {arguments: fragment}}` as the arguments are written, so that the
fragments of a call joined are its arguments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from gateway.api.protocol import ChatDelta
from gateway.api.protocol_tools import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from gateway.api.tool_parsers import Scan, ToolCallParser


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish_reason(scan: Scan, finish_reason: str | None) -> str | None:
    return "tool_calls" if scan.calls and finish_reason == "stop" else finish_reason


def whole_message(parser: ToolCallParser, text: str, finish_reason: str | None
                  ) -> tuple[ChatDelta, str | None]:
    """The assistant message of a whole response, and its finish_reason."""
    scan = parser.scan(text, is_final=True)
    calls = [ToolCall(id=_call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments))
             for c in scan.calls]
    message = ChatDelta(role="assistant", content=scan.content if scan.content or not calls else None,
                        tool_calls=calls or None)
    return message, tool_finish_reason(scan, finish_reason)


@dataclass
class _SentCall:
    id: str
    num_argument_chars: int = 0  # of the arguments' text already sent


@dataclass
class ToolCallStream:
    """One stream's tool-call state: what has been sent of the content and of each call."""

    parser: ToolCallParser
    text: str = ""
    num_content_chars: int = 0
    sent: list[_SentCall] = field(default_factory=list)
    last_scan: Scan = field(default_factory=lambda: Scan("", ()))

    def feed(self, text: str, is_final: bool) -> list[ChatDelta]:
        """The deltas to send after `text` (the model's next text); the last call has is_final."""
        self.text += text
        scan = self.last_scan = self.parser.scan(self.text, is_final)
        deltas = []
        if len(scan.content) > self.num_content_chars and scan.content.startswith(
                self.text[: self.num_content_chars]):
            deltas.append(ChatDelta(content=scan.content[self.num_content_chars :]))
            self.num_content_chars = len(scan.content)
        pieces = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break  # the name comes first: nothing of a later call before it either
            if index == len(self.sent):
                self.sent.append(_SentCall(_call_id()))
                pieces.append(ToolCallDelta(index=index, id=self.sent[index].id, type="function",
                                            function=FunctionCallDelta(name=call.name, arguments="")))
            sent = self.sent[index]
            if len(call.arguments) > sent.num_argument_chars:
                pieces.append(ToolCallDelta(index=index, function=FunctionCallDelta(
                    arguments=call.arguments[sent.num_argument_chars :])))
                sent.num_argument_chars = len(call.arguments)
        if pieces:
            deltas.append(ChatDelta(tool_calls=pieces))
        return deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return tool_finish_reason(self.last_scan, finish_reason)
