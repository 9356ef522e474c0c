"""Incremental detokenization with stop strings, for one request's stream.

Each add() turns new token ids into the text they complete, decoding each token once (the `tokenizers`
library's DecodeStream, for fast tokenizers); a token that ends inside a multi-byte character waits for
the next one (no U+FFFD reaches the client). Text that could be the start of a stop string is held back
until it is clear; when a stop string appears the text is cut before it.

vLLM's two fields apply here: skip_special_tokens (default true) leaves special tokens' text out;
include_stop_str_in_output keeps the stop string at the end of the text instead of cutting it off.

Only the text not yet handed out is kept: text that was handed out cannot hold the start of a stop string
(it would have been held back), so a stop string can only appear in what is still pending.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class _Decoder(Protocol):
    def step(self, token_id: int) -> str:
        """The text this token completes ("" while it ends inside a character)."""


class _StreamDecoder:
    """A fast tokenizer's own streaming decoder: each token is decoded once, with a few bytes of context."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


class _WindowDecoder:
    """For tokenizers without a Rust backend: decode a window [prefix_offset, len) and keep only what
    extends [prefix_offset, read_offset) (two decodes of a few tokens per token)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def step(self, token_id: int) -> str:
        self._token_ids.append(token_id)
        prefix = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._token_ids[self._prefix_offset :])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return window[len(prefix) :]
        return ""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str],
                 skip_special_tokens: bool = True, include_stop_str_in_output: bool = False) -> None:
        self.stop_strings = stop_strings
        self.include_stop_str_in_output = include_stop_str_in_output
        self.is_stopped = False
        self._pending = ""  # decoded, not handed out yet (may end with the start of a stop string)
        is_fast = getattr(tokenizer, "backend_tokenizer", None) is not None
        self._decoder: _Decoder = (_StreamDecoder(tokenizer, skip_special_tokens) if is_fast
                                   else _WindowDecoder(tokenizer, skip_special_tokens))

    def add(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Feed new tokens; returns the text that can be sent now (may be empty)."""
        if self.is_stopped:
            return ""
        for token_id in token_ids:
            self._pending += self._decoder.step(token_id)
        if self.stop_strings:
            self._find_stop()
        return self._take(final=self.is_stopped)

    def flush(self) -> str:
        """The request ended: hand out whatever was held back."""
        return self._take(final=True)

    def _find_stop(self) -> None:
        # The stop string that appears first ends the text (two may both be in one delta's pending text).
        found = [(index, stop) for stop in self.stop_strings if (index := self._pending.find(stop)) != -1]
        if found:
            index, stop = min(found, key=lambda pair: (pair[0], -len(pair[1])))
            end = index + len(stop) if self.include_stop_str_in_output else index
            self._pending = self._pending[:end]
            self.is_stopped = True

    def _take(self, final: bool) -> str:
        end = len(self._pending) if final or not self.stop_strings else len(self._pending) - self._held_back()
        delta, self._pending = self._pending[:end], self._pending[end:]
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that a stop string starts with."""
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:size]):
                    longest = size
                    break
        return longest
