"""One tool call's JSON object read as the model writes it, each character once (for streamed answers).

    GrowingText       the output so far, appended to in deltas; a slice costs its own length, not the text's
    JsonValueReader   the JSON value that starts at an offset: its strings, escapes and brackets followed as
                      they arrive, decoded once, when whole (or found not to be JSON)
    CallReader        gateway/api/tool_parsers.py's scan_call_object, resumable: it walks `{"name": ...,
                      "arguments": {...}}` key by key and value by value, keeping what is decided; what its
                      span() says after any delta is what scan_call_object says of the text so far
Offsets are into the whole output; arguments are a span of it (`args_start`, `args_end`), never a copy.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

_DECODER = json.JSONDecoder()
# What raw_decode raises for text that is no JSON: JSONDecodeError (a ValueError); ValueError for a number of
# more digits than int() takes; RecursionError for nesting past the recursion limit. Model output, not a bug.
NOT_JSON = (ValueError, RecursionError)
_SPACE = re.compile(r"\s*")
# JSON's structure outside strings and inside them; what a number or literal (true, NaN, -Infinity) can hold.
_OUTSIDE_STRING = re.compile(r'[\[\]{}"]')
_INSIDE_STRING = re.compile(r'["\\]')
_SCALAR_END = re.compile(r"[^0-9A-Za-z+\-.]")
_FIRST_WINDOW = 256  # characters a reader takes at once, doubled while a value goes on
_PIECE_CHARS = 1024  # GrowingText joins deltas into pieces of about this many characters


class GrowingText:
    """Text appended to in pieces (a stream's deltas), read by slices in time proportional to the slice."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._starts: list[int] = []  # each piece's offset in the text
        self.length = 0

    def append(self, piece: str) -> None:
        if not piece:
            return
        if self._pieces and len(self._pieces[-1]) < _PIECE_CHARS:
            self._pieces[-1] += piece  # deltas are a few characters: joined, most reads are of one piece
        else:
            self._pieces.append(piece)
            self._starts.append(self.length)
        self.length += len(piece)

    def slice(self, start: int, stop: int | None = None) -> str:
        """text[start:stop]."""
        stop = self.length if stop is None or stop > self.length else stop
        if start >= stop:
            return ""
        if start >= self._starts[-1]:  # within the last piece: most reads are
            return self._pieces[-1][start - self._starts[-1] : stop - self._starts[-1]]
        i = bisect.bisect_right(self._starts, start) - 1
        parts = []
        while i < len(self._pieces) and self._starts[i] < stop:
            offset = self._starts[i]
            parts.append(self._pieces[i][max(0, start - offset) : stop - offset])
            i += 1
        return "".join(parts)

    def find(self, sub: str, start: int) -> int:
        found = self.slice(start).find(sub)
        return -1 if found < 0 else start + found


def skip_space(text: GrowingText, pos: int, stop: int) -> int:
    """The first offset from `pos` (up to `stop`) that is not whitespace."""
    while pos < stop:
        window = text.slice(pos, min(stop, pos + 64))
        num_blank = _SPACE.match(window).end()  # type: ignore[union-attr]
        pos += num_blank
        if num_blank < len(window):
            break
    return pos


def decode(text: str) -> tuple[Any, int] | None:
    """json's raw_decode: the value that starts `text` and where it ends; None when there is none."""
    try:
        return _DECODER.raw_decode(text)
    except NOT_JSON:
        return None


class JsonValueReader:
    """The JSON value that starts at `start` (not a blank): followed as it grows, decoded once whole.

    A string, object or array is whole at its closing quote or bracket; a number or literal at the first
    character that cannot continue it. Then `is_decided`, with `value` and `end` (the offset after it), or
    end -1: not JSON. Until then, as for json's raw_decode of the text so far, there is no value (one that
    is already wrong but not closed, `{"a" x`, is not JSON either way, and waits)."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.is_decided = False
        self.value: Any = None
        self.end = -1
        self.is_scalar = False  # a number or literal (known once its first character is)
        self._pos = start  # the next character to read
        self._depth = 0  # of brackets, outside strings
        self._in_string = False
        self._is_escaped = False  # the previous character was a backslash in a string
        self._whole_at = -1  # the offset after the value's last character, once read

    def read(self, text: GrowingText, stop: int) -> None:
        """Follow the value through text[..stop) (stop: the text's end, or the end of what holds it)."""
        size = _FIRST_WINDOW
        while not self.is_decided and self._pos < stop:
            window = text.slice(self._pos, min(stop, self._pos + size))
            if self._pos == self.start:
                self.is_scalar = window[0] not in '{["'
            self._whole_at = self._read_scalar(window) if self.is_scalar else self._read_nested(window)
            if self._whole_at >= 0:
                self._decide(text)
            size *= 2

    def _read_nested(self, window: str) -> int:
        i = 0
        if self._is_escaped:
            i, self._is_escaped = 1, False
        while True:
            pattern = _INSIDE_STRING if self._in_string else _OUTSIDE_STRING
            match = pattern.search(window, i)
            if match is None:
                self._pos += len(window)
                return -1
            i = match.end()
            char = match.group()
            if char == "\\":
                if i == len(window):  # the escaped character is in the next window
                    self._is_escaped = True
                    self._pos += len(window)
                    return -1
                i += 1
                continue
            if char == '"':
                self._in_string = not self._in_string
            else:
                self._depth += 1 if char in "[{" else -1
            if self._depth == 0 and not self._in_string:
                self._pos += i
                return self._pos

    def _read_scalar(self, window: str) -> int:
        match = _SCALAR_END.search(window)
        if match is None:
            self._pos += len(window)
            return -1
        self._pos += match.start()
        return self._pos

    def _decide(self, text: GrowingText) -> None:
        self.is_decided = True
        decoded = decode(text.slice(self.start, self._whole_at))
        if decoded is not None:
            self.value, self.end = decoded[0], self.start + decoded[1]


@dataclass
class CallSpan:
    """A call as read so far: its arguments are text[args_start:args_end]."""

    name: str | None  # None until the name's string is closed
    args_start: int
    args_end: int
    is_complete: bool  # the call's whole object is closed, with a name


class _Step(Enum):
    OPEN = auto()  # blanks, then `{`
    KEY_OR_END = auto()  # blanks, then `}`, `,` or a key
    KEY = auto()  # blanks, then a key (any JSON value, as scan_call_object takes it)
    COLON = auto()
    VALUE = auto()  # blanks, then the value
    COMPLETE = auto()  # the object closed
    NOT_AN_OBJECT = auto()
    STUCK = auto()  # a key or value that is no JSON, or no colon: what was read is all there will be


_FINISHED = (_Step.COMPLETE, _Step.NOT_AN_OBJECT, _Step.STUCK)


class CallReader:
    """scan_call_object(text[start:stop], args_keys), read as the text grows (see the module docstring)."""

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.args_keys = args_keys
        self.step = _Step.OPEN
        self.name: str | None = None
        self._pos = start
        self._args = (start, start)  # the last whole arguments value's span
        self._key: Any = None
        self._item: JsonValueReader | None = None  # the key or value being read
        self._rest: StrippedEnd | None = None  # an arguments object or array not whole: the text from it on

    @property
    def is_not_a_call(self) -> bool:
        return self.step is _Step.NOT_AN_OBJECT

    def read(self, text: GrowingText, stop: int) -> None:
        """Read on through text[..stop)."""
        while self.step not in _FINISHED:
            if self.step in (_Step.KEY, _Step.VALUE):
                if not self._read_item(text, stop):
                    break
                continue
            self._pos = skip_space(text, self._pos, stop)
            if self._pos == stop:
                break
            char = text.slice(self._pos, self._pos + 1)
            if self.step is _Step.OPEN:
                self.step = _Step.KEY_OR_END if char == "{" else _Step.NOT_AN_OBJECT
            elif self.step is _Step.KEY_OR_END:
                self.step = _Step.COMPLETE if char == "}" else _Step.KEY
                if char not in "},":
                    continue  # the key starts here
            else:
                self.step = _Step.VALUE if char == ":" else _Step.STUCK
            self._pos += 1
        if self._rest is not None:
            self._rest.read(text, stop)

    def _read_item(self, text: GrowingText, stop: int) -> bool:
        """Read on the key or the value: whether it is decided (the walk goes on)."""
        if self._item is None:
            self._pos = skip_space(text, self._pos, stop)
            if self._pos == stop:
                return False
            self._item = JsonValueReader(self._pos)
            is_arguments = self.step is _Step.VALUE and self._key in self.args_keys
            if is_arguments and text.slice(self._pos, self._pos + 1) in ("{", "["):
                self._rest = StrippedEnd(self._pos)
        item = self._item
        item.read(text, stop)
        if not item.is_decided:
            return False
        self._item = None
        if item.end < 0:
            self.step = _Step.STUCK
            return False
        self._rest = None
        if self.step is _Step.KEY:
            self._key, self.step = item.value, _Step.COLON
        else:
            if self._key == "name" and isinstance(item.value, str):
                self.name = item.value
            elif self._key in self.args_keys:
                self._args = (item.start, item.end)
            self.step = _Step.KEY_OR_END
        self._pos = item.end
        return True

    def span(self, text: GrowingText) -> CallSpan | None:
        """What scan_call_object says of the text read so far (None: not an object)."""
        if self.step is _Step.NOT_AN_OBJECT:
            return None
        args_start, args_end = self._args
        item = self._item
        if self._rest is not None:  # as scan_call_object: an arguments object so far is the text to the end
            args_start, args_end = self._rest.start, self._rest.end
        elif item is not None and item.is_scalar and self.step is _Step.VALUE and self._key in self.args_keys:
            # A number being written reads as far as json can take it already (1 of "1.").
            decoded = decode(text.slice(item.start))
            if decoded is not None:
                args_start, args_end = item.start, item.start + decoded[1]
        is_complete = self.step is _Step.COMPLETE and self.name is not None
        return CallSpan(self.name, args_start, args_end, is_complete)


class StrippedEnd:
    """Where text[start:stop].rstrip(chars) ends, kept as `stop` moves on (it never moves back)."""

    def __init__(self, start: int, chars: str | None = None) -> None:
        self.start = self.end = self._num_read = start
        self._chars = chars

    def read(self, text: GrowingText, stop: int) -> None:
        window = text.slice(self._num_read, stop)
        kept = window.rstrip(self._chars)
        if kept:
            self.end = self._num_read + len(kept)
        self._num_read += len(window)
