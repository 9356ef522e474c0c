"""A chat answer read for tool calls, framed as OpenAI frames them.

Whole: the message's `content` (None when only calls were made) and its `tool_calls` (each with a minted
`call_...` id and the arguments' JSON text), finish_reason "tool_calls" when the model stopped after calls.
Streamed: after each text delta a stream scanner reads on from where the last delta's read stopped, and
says what the parser's scan of the output so far would (gateway/api/tool_stream_scan.py); ToolCallStream
sends only what is new: content text, then per call first `{index, id, type, function: {name, arguments:
""}}`, then `{index, function: {arguments: fragment}}` as the arguments are written, so that the fragments of
a call joined are its arguments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from gateway.api.protocol import ChatDelta
from gateway.api.protocol_tools import FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta
from gateway.api.tool_parsers import ToolCallParser
from gateway.api.tool_stream_scan import stream_scanner


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_finish_reason(has_calls: bool, finish_reason: str | None) -> str | None:
    return "tool_calls" if has_calls and finish_reason == "stop" else finish_reason


def whole_message(parser: ToolCallParser, text: str, finish_reason: str | None
                  ) -> tuple[ChatDelta, str | None]:
    """The assistant message of a whole response, and its finish_reason."""
    scan = parser.scan(text, is_final=True)
    calls = [ToolCall(id=_call_id(), function=FunctionCall(name=c.name or "", arguments=c.arguments))
             for c in scan.calls]
    message = ChatDelta(role="assistant", content=scan.content if scan.content or not calls else None,
                        tool_calls=calls or None)
    return message, tool_finish_reason(bool(scan.calls), finish_reason)


@dataclass
class _SentCall:
    id: str
    num_argument_chars: int = 0  # of the arguments' text already sent


class ToolCallStream:
    """One stream's tool-call state: what has been sent of the content and of each call."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.scanner = stream_scanner(parser)
        self.num_content_chars = 0  # of the content already sent
        self.sent: list[_SentCall] = []

    def feed(self, text: str, is_final: bool) -> list[ChatDelta]:
        """The deltas to send after `text` (the model's next text); the last call has is_final."""
        scanner = self.scanner
        scanner.feed(text, is_final)
        deltas = []
        if scanner.content_end > self.num_content_chars:  # the content is always a prefix of the text
            deltas.append(ChatDelta(content=scanner.text.slice(self.num_content_chars, scanner.content_end)))
            self.num_content_chars = scanner.content_end
        pieces = []
        first = max(0, len(self.sent) - 1)  # the calls before it are whole, and sent
        for index, call in enumerate(scanner.calls_from(first), start=first):
            if call.name is None:
                break  # the name comes first: nothing of a later call before it either
            if index == len(self.sent):
                self.sent.append(_SentCall(_call_id()))
                pieces.append(ToolCallDelta(index=index, id=self.sent[index].id, type="function",
                                            function=FunctionCallDelta(name=call.name, arguments="")))
            sent = self.sent[index]
            num_argument_chars = call.args_end - call.args_start
            if num_argument_chars > sent.num_argument_chars:
                fragment = scanner.text.slice(call.args_start + sent.num_argument_chars, call.args_end)
                pieces.append(ToolCallDelta(index=index, function=FunctionCallDelta(arguments=fragment)))
                sent.num_argument_chars = num_argument_chars
        if pieces:
            deltas.append(ChatDelta(tool_calls=pieces))
        return deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return tool_finish_reason(self.scanner.num_calls > 0, finish_reason)
