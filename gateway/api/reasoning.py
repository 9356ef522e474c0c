"""Reasoning parsers (`--reasoning-parser`): a thinking model's output split into reasoning and answer.

    qwen3        Qwen3 writes `<think>…</think>` then the answer. With thinking on (the default) the output
                 is reasoning up to `</think>` (an opening `<think>` is dropped; newer Qwen3 templates put it
                 in the prompt, so the output may have none); with `chat_template_kwargs: {"enable_thinking":
                 false}` the template closes an empty think block in the prompt and the whole output is the
                 answer. A `<tool_call>` written while thinking also ends the reasoning (as vLLM's qwen3
                 parser): the call is the answer's, for the tool parser to read.
    deepseek_r1  DeepSeek-R1's template opens `<think>` in the prompt: the output starts inside the reasoning
                 (an opening `<think>` the model writes anyway is dropped) and the answer follows `</think>`.
In both, an output that never closes the block (cut by max_tokens) is all reasoning, and the text after the
first `</think>` is the answer verbatim (as vLLM: its leading newlines kept). Empty parts are None, as vLLM
reports them. The parsers read text, not token ids: a tag split over several deltas (a tokenizer without the
tag as one token, or a detokenizer holding back a partial character) is still found; the stream holds back
only text that could be the start of a tag.

A whole answer is `split(text)`; a stream is a ReasoningStream per choice, whose pieces joined are exactly
what split() says of the whole text (tests/gateway/test_reasoning.py checks every way of cutting it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from gateway.api.tool_parsers import held_back

if TYPE_CHECKING:
    from gateway.api.protocol import ChatDelta

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParserName(StrEnum):
    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


@dataclass(frozen=True)
class Split:
    """One answer's parts: None where a part is empty (as vLLM's message fields)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningParser:
    """How one model family marks its reasoning (one instance per server: `--reasoning-parser`)."""

    name: ReasoningParserName
    follows_enable_thinking: bool  # qwen3: `enable_thinking: false` makes the whole output the answer
    implicit_ends: tuple[str, ...] = ()  # tags that end the reasoning and begin the answer (kept in it)

    def starts_in_reasoning(self, chat_template_kwargs: Mapping[str, Any] | None, is_constrained: bool = False
                            ) -> bool:
        """Whether a request's output begins inside the reasoning (its chat_template_kwargs, if any).

        Args:
            is_constrained: the output is held to a grammar (response_format, a forced tool call) from its
                first token, so the model writes no reasoning: it is all content. (vLLM lets the model think
                first and applies the grammar after `</think>`; pdserve's grammar has no such gate yet.)
        """
        if is_constrained:
            return False
        if not self.follows_enable_thinking or not chat_template_kwargs:
            return True
        return chat_template_kwargs.get("enable_thinking", True) is not False

    def stream(self, starts_in_reasoning: bool = True) -> ReasoningStream:
        """One choice's stream."""
        return ReasoningStream(starts_in_reasoning, self.implicit_ends)

    def split(self, text: str, starts_in_reasoning: bool = True) -> Split:
        """A whole answer's reasoning and content."""
        stream = self.stream(starts_in_reasoning)
        reasoning, content = stream.feed(text, is_final=True)
        return Split(reasoning or None, content or None)


PARSERS: dict[ReasoningParserName, ReasoningParser] = {
    ReasoningParserName.QWEN3: ReasoningParser(ReasoningParserName.QWEN3, follows_enable_thinking=True,
                                               implicit_ends=("<tool_call>",)),
    ReasoningParserName.DEEPSEEK_R1: ReasoningParser(ReasoningParserName.DEEPSEEK_R1,
                                                     follows_enable_thinking=False),
}


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser of that name (None: none).

    Raises:
        ValueError: an unknown name; the message lists the known ones.
    """
    if name is None:
        return None
    try:
        return PARSERS[ReasoningParserName(name)]
    except ValueError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}") from None


class ReasoningStream:
    """One choice's output, delta by delta: what each delta adds to the reasoning and to the content.

    Inside the reasoning, `<think>` is dropped and `</think>` ends it; text that could be the start of either
    tag waits for the next delta (or the last one). After `</think>` every character is content at once.
    """

    def __init__(self, starts_in_reasoning: bool = True, implicit_ends: tuple[str, ...] = ()) -> None:
        self.is_reasoning = starts_in_reasoning
        self._implicit_ends = implicit_ends  # tags that end the reasoning and stay, as the answer's start
        self._tags = (THINK_START, THINK_END, *implicit_ends)
        self._pending = ""  # reasoning text that may still be the start of a tag (shorter than the tag)

    def feed(self, text: str, is_final: bool) -> tuple[str, str]:
        """(reasoning, content) this text adds; with is_final everything held back comes out."""
        if not self.is_reasoning:
            return "", text
        pending = self._pending + text
        self._pending = ""
        reasoning: list[str] = []
        while True:
            found = [(at, tag) for tag in self._tags if (at := pending.find(tag)) >= 0]
            if not found:
                break
            at, tag = min(found)  # the first tag written
            reasoning.append(pending[:at])
            if tag == THINK_START:  # an opening tag inside the reasoning: dropped
                pending = pending[at + len(tag):]
                continue
            self.is_reasoning = False
            return "".join(reasoning), pending[at + len(tag) if tag == THINK_END else at:]
        num_held = 0 if is_final else max(held_back(pending, tag) for tag in self._tags)
        reasoning.append(pending[:len(pending) - num_held])
        self._pending = pending[len(pending) - num_held:]
        return "".join(reasoning), ""


def with_reasoning(message: ChatDelta, reasoning: str | None) -> ChatDelta:
    """The message with its reasoning under both of vLLM's names (`reasoning`, and `reasoning_content`
    that older clients read)."""
    if not reasoning:
        return message
    return message.model_copy(update={"reasoning": reasoning, "reasoning_content": reasoning})
