"""A stream's tool-call scan, resumed after each delta where the last one stopped.

A parser's scan(text, is_final) (gateway/api/tool_parsers.py) reads a whole answer, and stays the definition.
Run after every delta of a stream it would read the output again each time: O(n²), seconds of event-loop
time for a long call. A StreamScanner keeps what is decided (the content before the first call, each call
whose object and closing tag are written, the position every search and read reached) and reads on from
there, so each character is read about once; after every delta it says exactly what scan(text so far,
is_final) says (tests/gateway/test_tool_parsers.py checks the two on every prefix), in offsets:

    content_end         the content is text[:content_end]
    calls_from(index)   the calls from `index` on, each a CallSpan (gateway/api/call_reader.py)

    hermes       no call yet → a call being written (a CallReader, until its closing tag) → the next one …;
                 a call's body that is not a call makes the rest content, for good
    llama3_json  leading blanks → `<|python_tag|>`? → blanks → `{`: the objects (each a CallReader, and a
                 JsonValueReader for where it ends), `;`-separated; anything else first: all content
"""

from __future__ import annotations

from enum import Enum, auto

from gateway.api.call_reader import (
    CallReader,
    CallSpan,
    GrowingText,
    JsonValueReader,
    StrippedEnd,
    skip_space,
)
from gateway.api.tool_parsers import HermesParser, Llama3JsonParser, ToolCallParser, held_back


class StreamScanner:
    ARGS_KEYS: tuple[str, ...] = ()  # the keys a call's arguments are read under, as the parser's scan reads

    def __init__(self) -> None:
        self.text = GrowingText()
        self.content_end = 0  # after the last feed: the content is text[:content_end]
        self._calls: list[CallSpan] = []  # the decided calls (appended to only)
        self._num_shown = 0  # of _calls, in the last feed's scan
        self._last: CallSpan | None = None  # the call being written, in the last feed's scan

    def feed(self, delta: str, is_final: bool) -> None:
        """Read `delta` (the model's next text); content_end and calls_from() then say what scan() says of the
        text so far."""
        self.text.append(delta)
        self._read()
        self._show(is_final)

    @property
    def num_calls(self) -> int:
        return self._num_shown + (self._last is not None)

    def calls_from(self, index: int) -> list[CallSpan]:
        calls = self._calls[index : self._num_shown]
        if self._last is not None and index <= self._num_shown:
            calls.append(self._last)
        return calls

    def _read(self) -> None:
        raise NotImplementedError

    def _show(self, is_final: bool) -> None:
        """Set content_end and the calls shown from the state _read() left."""
        raise NotImplementedError

    def _set(self, content_end: int, num_calls: int = 0, last: CallSpan | None = None) -> None:
        self.content_end, self._num_shown, self._last = content_end, num_calls, last

    def _show_whole_text(self) -> None:
        self._set(self.text.length)


class HermesScanner(StreamScanner):
    OPEN, CLOSE = HermesParser.OPEN, HermesParser.CLOSE
    ARGS_KEYS = (HermesParser.args_key,)

    def __init__(self) -> None:
        super().__init__()
        self._content = StrippedEnd(0, "\n")  # before the first call: the text, less trailing newlines
        self._first_open = -1  # where the first call's tag starts
        self._searched = 0  # where the next search for a tag starts
        self._call: CallReader | None = None  # the call being written (its closing tag not yet)
        self._is_not_a_call = False  # a call's body was not one: the text from the first tag is content

    def _read(self) -> None:
        text = self.text
        while not self._is_not_a_call:
            if self._call is None:
                start = self._find(self.OPEN)
                if start < 0:
                    break
                if self._first_open < 0:
                    self._first_open = start
                    self._content.read(text, start)
                self._searched = start + len(self.OPEN)
                self._call = CallReader(self._searched, self.ARGS_KEYS)
            end = self._find(self.CLOSE)
            self._call.read(text, text.length if end < 0 else end)  # the body ends at the closing tag
            if end < 0:
                self._is_not_a_call = self._call.is_not_a_call
                break
            call = self._call.span(text)
            if call is None or not call.is_complete:
                self._is_not_a_call = True
                break
            self._calls.append(call)
            self._call, self._searched = None, end
        if self._first_open < 0:  # text that might still open a call is held back
            tail = text.slice(max(0, text.length - len(self.OPEN)))
            self._content.read(text, text.length - held_back(tail, self.OPEN))

    def _find(self, tag: str) -> int:
        found = self.text.find(tag, self._searched)
        if found < 0:
            self._searched = max(self._searched, self.text.length - len(tag) + 1)
        return found

    def _show(self, is_final: bool) -> None:
        if self._first_open < 0:
            self._set(self.text.length if is_final else self._content.end)
        elif self._is_not_a_call:
            if is_final:
                self._show_whole_text()
            else:
                self._set(self._first_open, len(self._calls))
        else:
            last = self._call.span(self.text) if self._call is not None else None
            if is_final and last is not None and not last.is_complete:
                self._show_whole_text()
            else:
                self._set(self._content.end, len(self._calls), last)


class _Llama3Step(Enum):
    LEADING_BLANKS = auto()
    TAG = auto()  # `<|python_tag|>` or not
    BLANKS_AFTER_TAG = auto()
    BODY = auto()  # `{`, or not a call: all content
    PLAIN = auto()
    PIECE_START = auto()  # blanks, then an object (an empty one so far when only blanks)
    PIECE = auto()
    AFTER_PIECE = auto()  # blanks, then `;` or the next object
    AFTER_SEMICOLON = auto()
    LAST_PIECE = auto()  # an object that never parses: the rest of the text is this call's
    NOT_A_CALL = auto()


_BLANKS_FIRST = (_Llama3Step.LEADING_BLANKS, _Llama3Step.BLANKS_AFTER_TAG, _Llama3Step.PIECE_START,
                 _Llama3Step.AFTER_PIECE)


class Llama3Scanner(StreamScanner):
    TAG = Llama3JsonParser.PYTHON_TAG
    ARGS_KEYS = (Llama3JsonParser.args_key, "arguments")

    def __init__(self) -> None:
        super().__init__()
        self._step = _Llama3Step.LEADING_BLANKS
        self._pos = 0
        self._call: CallReader | None = None  # the object being written
        self._value: JsonValueReader | None = None  # where that object ends
        self._is_all_complete = True  # of self._calls

    def _read(self) -> None:
        text, step = self.text, _Llama3Step
        while self._pos < text.length:
            if self._step in _BLANKS_FIRST:
                self._pos = skip_space(text, self._pos, text.length)
                if self._pos == text.length:
                    break
            char = text.slice(self._pos, self._pos + 1)
            if self._step in (step.PLAIN, step.NOT_A_CALL):
                break
            if self._step is step.LEADING_BLANKS:
                self._step = step.TAG
            elif self._step is step.TAG:
                head = text.slice(self._pos, self._pos + len(self.TAG))
                if head == self.TAG:
                    self._step, self._pos = step.BLANKS_AFTER_TAG, self._pos + len(self.TAG)
                elif self.TAG.startswith(head):
                    break  # the tag's beginning: it may still be the tag
                else:
                    self._step = step.BODY
            elif self._step is step.BLANKS_AFTER_TAG:
                self._step = step.BODY
            elif self._step is step.BODY:
                self._step = step.PIECE_START if char == "{" else step.PLAIN
            elif self._step is step.PIECE_START:
                self._call, self._value = CallReader(self._pos, self.ARGS_KEYS), JsonValueReader(self._pos)
                self._step = step.PIECE
            elif self._step in (step.PIECE, step.LAST_PIECE):
                if not self._read_piece():
                    break
            elif self._step is step.AFTER_PIECE:
                if char == ";":
                    self._step, self._pos = step.AFTER_SEMICOLON, self._pos + 1
                else:
                    self._step = step.PIECE_START
            else:  # after `;`: a piece starts once anything follows
                self._step = step.PIECE_START

    def _read_piece(self) -> bool:
        """Read on the object being written: whether it is whole (and the next one may start)."""
        assert self._call is not None and self._value is not None
        self._call.read(self.text, self.text.length)
        if self._call.is_not_a_call:
            self._step = _Llama3Step.NOT_A_CALL
            return False
        if self._step is _Llama3Step.LAST_PIECE:
            return False
        self._value.read(self.text, self.text.length)
        if not self._value.is_decided:
            return False
        if self._value.end < 0:
            self._step = _Llama3Step.LAST_PIECE
            return False
        call = self._call.span(self.text)
        assert call is not None
        self._calls.append(call)
        self._is_all_complete &= call.is_complete
        self._call, self._pos, self._step = None, self._value.end, _Llama3Step.AFTER_PIECE
        return True

    def _show(self, is_final: bool) -> None:
        step = self._step
        if step in (_Llama3Step.LEADING_BLANKS, _Llama3Step.BLANKS_AFTER_TAG):
            self._set(self.text.length if is_final else 0)
            return
        if step in (_Llama3Step.TAG, _Llama3Step.PLAIN):
            self._show_whole_text()
            return
        last = None
        if step is _Llama3Step.PIECE_START:  # only blanks so far: an empty object, no name yet
            last = CallSpan(None, self._pos, self._pos, False)
        elif step in (_Llama3Step.PIECE, _Llama3Step.LAST_PIECE) and self._call is not None:
            last = self._call.span(self.text)
        is_all_complete = self._is_all_complete and (last is None or last.is_complete)
        if is_final and (step is _Llama3Step.NOT_A_CALL or not (self._calls or last) or not is_all_complete):
            self._show_whole_text()
        else:
            self._set(0, len(self._calls), last)


_SCANNERS: dict[str, type[StreamScanner]] = {"hermes": HermesScanner, "llama3_json": Llama3Scanner}


def stream_scanner(parser: ToolCallParser) -> StreamScanner:
    """A scanner that reads a stream as `parser` reads whole answers.

    Raises:
        ValueError: a parser with no stream scanner (the message lists the known ones).
    """
    if parser.name not in _SCANNERS:
        raise ValueError(f"no stream scanner for tool-call parser {parser.name!r}; known: "
                         f"{', '.join(sorted(_SCANNERS))}")
    return _SCANNERS[parser.name]()
