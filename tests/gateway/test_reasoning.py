"""Reasoning parsers (gateway/api/reasoning.py): whole answers as vLLM's qwen3 and deepseek_r1 parsers split
them, and streams cut at every place (tags split across deltas) giving the same parts."""

from __future__ import annotations

import pytest

from gateway.api.reasoning import (
    PARSERS,
    ReasoningStream,
    Split,
    reasoning_parser,
)

QWEN3 = PARSERS["qwen3"]  # type: ignore[index]
R1 = PARSERS["deepseek_r1"]  # type: ignore[index]

# (output, starts in reasoning?) → (reasoning, content), as vLLM reports them.
CASES = [
    ("<think>\nLet me add.\n</think>\n\nThe sum is 4.", True, Split("\nLet me add.\n", "\n\nThe sum is 4.")),
    ("Let me add.</think>The sum is 4.", True, Split("Let me add.", "The sum is 4.")),  # <think> was prompt
    ("<think>still thinking when max_tokens", True, Split("still thinking when max_tokens", None)),
    ("no tags at all", True, Split("no tags at all", None)),
    ("<think>done</think>", True, Split("done", None)),  # stopped right after the block
    ("<think></think>answer", True, Split(None, "answer")),
    ("a</think>b</think>c", True, Split("a", "b</think>c")),  # after the block, content verbatim
    ("<think>x<think>y</think>z", True, Split("xy", "z")),
    ("The answer, no thinking. </think>", False, Split(None, "The answer, no thinking. </think>")),
    ("", True, Split(None, None)),
    ("a < b <th and </thi", True, Split("a < b <th and </thi", None)),  # partial tags at the end are text
]


@pytest.mark.parametrize("text,starts,expected", CASES)
def test_whole_answer_splits_as_vllm(text: str, starts: bool, expected: Split) -> None:
    assert QWEN3.split(text, starts) == expected
    assert R1.split(text, starts) == expected


TOOL_CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_qwen3_ends_the_reasoning_at_a_tool_call_and_deepseek_r1_does_not() -> None:
    text = f"<think>I should call f. {TOOL_CALL}"
    assert QWEN3.split(text) == Split("I should call f. ", TOOL_CALL)  # the call is the answer's
    assert R1.split(text) == Split(f"I should call f. {TOOL_CALL}", None)
    for cut in range(len(text) + 1):
        stream = QWEN3.stream()
        first, second = stream.feed(text[:cut], is_final=False), stream.feed(text[cut:], is_final=True)
        assert (first[0] + second[0], first[1] + second[1]) == ("I should call f. ", TOOL_CALL)


def _streamed(text: str, cuts: list[int], starts: bool = True) -> tuple[list[str], list[str]]:
    stream = ReasoningStream(starts)
    bounds = [0, *cuts, len(text)]
    reasoning, content = [], []
    for i in range(len(bounds) - 1):
        r, c = stream.feed(text[bounds[i]:bounds[i + 1]], is_final=i == len(bounds) - 2)
        reasoning.append(r)
        content.append(c)
    return reasoning, content


@pytest.mark.parametrize("text,starts,expected", CASES)
def test_a_stream_cut_anywhere_joins_to_the_whole_split(text: str, starts: bool, expected: Split) -> None:
    for cut in range(len(text) + 1):  # one cut at every place: each tag split at every character
        reasoning, content = _streamed(text, [cut], starts)
        assert Split("".join(reasoning) or None, "".join(content) or None) == expected
    reasoning, content = _streamed(text, list(range(1, len(text))), starts)  # a character per delta
    assert Split("".join(reasoning) or None, "".join(content) or None) == expected


def test_only_a_possible_tag_is_held_back() -> None:
    stream = ReasoningStream()
    assert stream.feed("I think", is_final=False) == ("I think", "")
    assert stream.feed(" so </th", is_final=False) == (" so ", "")  # "</th" may be the closing tag
    assert stream.feed("ink>\n\nYes", is_final=False) == ("", "\n\nYes")
    assert stream.feed(" <think> stays", is_final=False) == ("", " <think> stays")  # content: verbatim
    assert stream.feed("", is_final=True) == ("", "")


def test_qwen3_follows_enable_thinking_and_deepseek_r1_does_not() -> None:
    assert QWEN3.starts_in_reasoning(None)
    assert QWEN3.starts_in_reasoning({"enable_thinking": True})
    assert not QWEN3.starts_in_reasoning({"enable_thinking": False})
    assert R1.starts_in_reasoning({"enable_thinking": False})  # R1's template always opens the block
    # Held to a grammar from the first token (response_format, a forced call), the model writes no reasoning.
    assert not QWEN3.starts_in_reasoning(None, is_constrained=True)
    assert not R1.starts_in_reasoning(None, is_constrained=True)


def test_parsers_by_name() -> None:
    assert reasoning_parser(None) is None
    assert reasoning_parser("qwen3") is QWEN3
    with pytest.raises(ValueError, match="known: qwen3, deepseek_r1"):
        reasoning_parser("granite")


def test_the_flag_offers_exactly_the_parsers() -> None:
    import typing

    from gateway.config import ServeConfig

    annotation = ServeConfig.model_fields["reasoning_parser"].annotation
    [choices] = [a for a in typing.get_args(annotation) if a is not type(None)]
    assert typing.get_args(choices) == tuple(PARSERS)
