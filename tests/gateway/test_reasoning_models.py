"""Reasoning models without a server: --generation-config's defaults, --chat-template, the chat max_tokens
default, and the chat framing (whole and streamed) with a reasoning parser, on the small Qwen3 checkpoint's
real tokenizer and template (tests/helpers/qwen3_small.py)."""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.api.chat_responses import chat_response, chat_stream
from gateway.api.chat_template import load_chat_template
from gateway.api.logprob_format import TokenTexts
from gateway.api.prepare import Preparer
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from gateway.api.reasoning import PARSERS
from gateway.api.sampling_defaults import SamplingDefaults, check_generation_config, read_sampling_defaults
from gateway.api.tool_parsers import choose_parser
from gateway.requests.prepared import PreparedRequest, TextDelta
from llm_engine import SamplingParams
from llm_engine.model_files import load_tokenizer, read_model_spec

QWEN3 = PARSERS["qwen3"]  # type: ignore[index]
ASK = [ChatMessage(role="user", content="What is 2+2?")]


def write_generation_config(folder: Path, **values: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def test_auto_reads_the_models_sampling_defaults(qwen3_small_dir: Path) -> None:
    defaults = read_sampling_defaults("auto", str(qwen3_small_dir))
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 20)  # Qwen3's
    assert defaults.max_tokens is None and defaults.max_tokens_cap is None
    assert read_sampling_defaults("vllm", str(qwen3_small_dir)) == SamplingDefaults()


def test_a_directory_given_caps_max_tokens(tmp_path: Path) -> None:
    folder = write_generation_config(tmp_path / "gen", max_new_tokens=100, top_k=-1, repetition_penalty=1.1,
                                     min_p=0.05)
    defaults = read_sampling_defaults(str(folder), "/no/model/dir")
    assert defaults.top_k == 0  # transformers' "no top_k" is pdserve's 0
    assert (defaults.repetition_penalty, defaults.max_tokens, defaults.max_tokens_cap) == (1.1, 100, 100)
    assert defaults.min_p == 0.05
    # auto: the model's own max_new_tokens is a default, not a cap (as vLLM).
    assert read_sampling_defaults("auto", str(folder)).max_tokens_cap is None


def test_bad_generation_configs_stop_at_load(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="has none"):
        check_generation_config(str(tmp_path))
    folder = write_generation_config(tmp_path / "bad", top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        read_sampling_defaults(str(folder), "")


@functools.cache
def tokenizer_of(model_dir: Path) -> Any:
    """Loaded once for the module: Qwen3's 150k-token tokenizer takes a second or more to load."""
    return load_tokenizer(str(model_dir))


def preparer(model_dir: Path, defaults: SamplingDefaults | None = None, default_max_tokens: int | None = None
             ) -> Preparer:
    tokenizer = tokenizer_of(model_dir)
    return Preparer(tokenizer, read_model_spec(str(model_dir)), "m", 100_000, default_max_tokens, 16,
                    reasoning_parser=QWEN3, sampling_defaults=defaults)


def prepare(preparer: Preparer, **fields: Any) -> PreparedRequest:
    return asyncio.run(preparer.prepare_chat(ChatCompletionRequest(model="m", messages=ASK, **fields)))


def test_unset_fields_take_the_generation_configs_values_set_ones_keep_theirs(qwen3_small_dir: Path) -> None:
    ready = preparer(qwen3_small_dir, read_sampling_defaults("auto", str(qwen3_small_dir)))
    unset = prepare(ready).sampling
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.95, 20)
    chosen = prepare(ready, temperature=1.0, top_p=1.0, top_k=0).sampling  # the neutral values, set
    assert (chosen.temperature, chosen.top_p, chosen.top_k) == (1.0, 1.0, 0)
    assert prepare(ready, temperature=0.0).sampling.temperature == 0.0  # greedy stays greedy
    plain = prepare(preparer(qwen3_small_dir)).sampling  # --generation-config vllm
    assert (plain.temperature, plain.top_p, plain.top_k) == (1.0, 1.0, 0)


def test_chat_max_tokens_unset_is_the_rest_of_the_context(qwen3_small_dir: Path, tmp_path: Path) -> None:
    prepared = prepare(preparer(qwen3_small_dir))
    assert prepared.sampling.max_tokens == 2048 - len(prepared.prompt_token_ids)  # max_position_embeddings
    assert prepare(preparer(qwen3_small_dir, default_max_tokens=64)).sampling.max_tokens == 64
    capped = read_sampling_defaults(str(write_generation_config(tmp_path / "g", max_new_tokens=100)), "")
    assert prepare(preparer(qwen3_small_dir, capped)).sampling.max_tokens == 100
    assert prepare(preparer(qwen3_small_dir, capped), max_tokens=500).sampling.max_tokens == 100  # a cap


def test_chat_template_from_a_file_or_its_text(qwen3_small_dir: Path, tmp_path: Path) -> None:
    template = qwen3_small_dir / "chat_template.jinja"
    assert load_chat_template(str(template)) == template.read_text()
    literal = "{% for m in messages %}{{ m.content }}\\n{% endfor %}"  # backslash-n, as a shell passes it
    assert load_chat_template(literal).endswith("}\n{% endfor %}")
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")


def test_the_qwen3_template_closes_the_think_block_when_thinking_is_off(qwen3_small_dir: Path) -> None:
    tokenizer = tokenizer_of(qwen3_small_dir)
    messages = [{"role": "user", "content": "hi"}]
    on = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    off = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                        enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]  # Qwen3's ids
    assert choose_parser("auto", tokenizer.chat_template).name == "hermes"


# The framing, fed deltas as a worker would send them.
OUTPUT = "<think>\nLet me think.\n</think>\n\nThe answer is four."
CALL = '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'


async def deltas_of(text: str, size: int) -> AsyncIterator[TextDelta]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for i, piece in enumerate(pieces):
        is_last = i == len(pieces) - 1
        yield TextDelta(piece, (1,), (), finish_reason="stop" if is_last else None,
                        num_output_tokens=i + 1)


def framing_args(qwen3_small_dir: Path, **fields: Any) -> tuple[Any, TokenTexts, ChatCompletionRequest,
                                                                 PreparedRequest]:
    tokenizer = tokenizer_of(qwen3_small_dir)
    body = ChatCompletionRequest(model="m", messages=ASK, **fields)
    prepared = PreparedRequest("chatcmpl-1", (1, 2, 3), SamplingParams(max_tokens=64), [], 0.0)
    return SimpleNamespace(model_name="m"), TokenTexts(tokenizer), body, prepared


def test_a_whole_answer_carries_reasoning_apart(qwen3_small_dir: Path) -> None:
    service, texts, body, prepared = framing_args(qwen3_small_dir)
    answer = asyncio.run(chat_response(service, texts, body, prepared, deltas_of(OUTPUT, 7), reasoning=QWEN3))
    message = answer.choices[0].message
    assert message is not None
    assert message.reasoning == message.reasoning_content == "\nLet me think.\n"
    assert message.content == "\n\nThe answer is four."
    hermes = choose_parser("hermes", None)
    called = asyncio.run(chat_response(service, texts, body, prepared, deltas_of(CALL, 5), hermes, QWEN3))
    message = called.choices[0].message
    assert message is not None and message.reasoning == "\nplan\n" and message.content is None
    assert [c.function.name for c in message.tool_calls or []] == ["add"]  # type: ignore[union-attr]
    assert called.choices[0].finish_reason == "tool_calls"


def collect(stream: AsyncIterator[str]) -> list[dict[str, Any]]:
    async def run() -> list[str]:
        return [event async for event in stream]
    payloads = [event.removeprefix("data: ").strip() for event in asyncio.run(run())]
    return [json.loads(p) for p in payloads if p != "[DONE]"]


@pytest.mark.parametrize("size", [1, 2, 3, 8, 100])
def test_a_stream_carries_reasoning_apart_however_the_deltas_fall(qwen3_small_dir: Path, size: int) -> None:
    service, texts, body, prepared = framing_args(qwen3_small_dir, stream=True)
    chunks = collect(chat_stream(service, texts, body, prepared, deltas_of(OUTPUT, size), False,
                                 reasoning=QWEN3))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    reasoning = "".join(d.get("reasoning", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning_content", "") for d in deltas) == "\nLet me think.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nThe answer is four."
    assert not any("<think>" in json.dumps(d) or "</think>" in json.dumps(d) for d in deltas)
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("reasoning") for d in deltas[first_content + 1:])  # the reasoning comes first
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_tool_call_after_the_reasoning(qwen3_small_dir: Path) -> None:
    service, texts, body, prepared = framing_args(qwen3_small_dir, stream=True)
    chunks = collect(chat_stream(service, texts, body, prepared, deltas_of(CALL, 3), False,
                                 choose_parser("hermes", None), QWEN3))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nplan\n"
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    arguments = "".join(call["function"].get("arguments", "") for call in calls)
    assert json.loads(arguments) == {"a": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_without_the_block_closed_all_is_reasoning(qwen3_small_dir: Path) -> None:
    service, texts, body, prepared = framing_args(qwen3_small_dir)
    cut = asyncio.run(chat_response(service, texts, body, prepared, deltas_of("<think>\nhmm, so", 4),
                                    reasoning=QWEN3))
    message = cut.choices[0].message
    assert message is not None and message.reasoning == "\nhmm, so" and message.content is None


def test_a_history_gives_the_template_its_reasoning_back(qwen3_small_dir: Path) -> None:
    """A client sends the assistant's message back as it got it (reasoning included): Qwen3's template shows
    the reasoning of the turn after the last question."""
    ready = preparer(qwen3_small_dir)
    history = [ChatMessage(role="user", content="What is 2+2?"),
               ChatMessage(role="assistant", content="4", reasoning="adding"),
               ChatMessage(role="assistant", content="yes", reasoning_content="checking")]
    text = ready.tokenizer.decode(asyncio.run(ready.render_chat(history, add_generation_prompt=False)))
    assert "<think>\nchecking\n</think>\n\nyes" in text


def test_an_answer_held_to_a_grammar_is_all_content(qwen3_small_dir: Path) -> None:
    """response_format holds the output to JSON from its first token: no reasoning can come first."""
    from dataclasses import replace

    from llm_engine.structured import GrammarSpec

    service, texts, body, prepared = framing_args(qwen3_small_dir)
    grammar = GrammarSpec.of_schema({"type": "object"})
    held = replace(prepared, sampling=SamplingParams(max_tokens=64, grammar=grammar))
    answer = asyncio.run(chat_response(service, texts, body, held, deltas_of('{"a": 1}', 3), reasoning=QWEN3))
    message = answer.choices[0].message
    assert message is not None and message.content == '{"a": 1}' and message.reasoning is None
