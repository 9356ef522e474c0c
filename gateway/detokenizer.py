"""Incremental detokenization with stop strings, for one request's stream.

Each add() turns new token ids into the text they complete; a token that ends inside a multi-byte
character waits for the next one (no U+FFFD reaches the client). Text that could be the start of a stop
string is held back until it is clear; when a stop string appears the text is cut before it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop_strings: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.token_ids: list[int] = []
        self.text = ""  # all decoded text so far (cut at a stop string once found)
        self.num_emitted = 0  # characters of self.text already handed out
        self.is_stopped = False
        # Decode a window [prefix_offset, len) and keep only what extends [prefix_offset, read_offset).
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def add(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Feed new tokens; returns the text that can be sent now (may be empty)."""
        if self.is_stopped:
            return ""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            window = self._decode(self.token_ids[self._prefix_offset :])
            if len(window) > len(prefix) and not window.endswith("\ufffd"):
                self.text += window[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = len(self.token_ids)
        self._find_stop()
        return self._take(final=self.is_stopped)

    def flush(self) -> str:
        """The request ended: hand out whatever was held back."""
        return self._take(final=True)

    def _find_stop(self) -> None:
        for stop in self.stop_strings:
            # Only the new text (plus an overlap) can hold a stop string not seen before.
            index = self.text.find(stop, max(0, self.num_emitted - len(stop) + 1))
            if index != -1:
                self.text = self.text[:index]
                self.is_stopped = True

    def _take(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self._held_back()
        delta = self.text[self.num_emitted : end]
        self.num_emitted = max(self.num_emitted, end)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that a stop string starts with."""
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
