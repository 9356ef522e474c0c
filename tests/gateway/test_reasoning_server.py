"""A reasoning model through 1 prefill + 1 decode on Ray, with the unmodified openai SDK: the small Qwen3
checkpoint (tests/helpers/qwen3_small.py: Qwen3's architecture, tokenizer, template and
generation_config.json; a model that writes `<think>Let me think</think>\\n\\nThe answer is four`),
--reasoning-parser qwen3. The requests name no max_tokens and no temperature: the rest of the context and
Qwen3's sampling defaults (temperature 0.6, top_k 20) apply, as on vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdserve.main import build_parser
from pdserve.serve import load_serve_config
from tests.helpers import two_stage_server
from tests.helpers.qwen3_small import ANSWER, REASONING
from tests.helpers.servers import MODEL, free_port, serving

pytestmark = pytest.mark.slow
ASK: list[Any] = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def server(qwen3_small_dir: Path, ray_local: None) -> Iterator[str]:
    # Started from a command line as a vLLM user types it (issue 33's acceptance line, pdserve/vllm_flags.py).
    # float32 and F.linear rather than --dtype half (auto on a CPU): the linear-kernel probe of a 152k-token
    # LM head in bfloat16 takes minutes on 2 shared cores; test_vllm_flags.py checks what half becomes.
    argv = ["serve", str(qwen3_small_dir), "--reasoning-parser", "qwen3", "--enable-prefix-caching",
            "--enable-chunked-prefill", "--enable-auto-tool-choice", "--dtype", "float", "-tp", "1",
            "--linear-kernel", "torch", "--served-model-name", MODEL, "--port", str(free_port()),
            "--prefill", "1", "--decode", "1", "--kv-cache-memory-bytes", "8M",
            "--max-num-batched-tokens", "256"]
    with serving(load_serve_config(build_parser().parse_args(argv))) as (url, _):
        yield url


# The two-stage suites' clients of this module's own `server` (tests/helpers/two_stage_server.py).
sdk, client = two_stage_server.sdk, two_stage_server.client


def test_the_reasoning_comes_apart_from_the_answer(sdk: openai.OpenAI, client: httpx.Client) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK)
    [choice] = answer.choices
    message: Any = choice.message
    assert message.reasoning == message.reasoning_content == REASONING
    assert message.content == f"\n\n{ANSWER}"
    assert choice.finish_reason == "stop"


def test_a_streamed_answer_carries_the_reasoning_in_its_own_deltas(sdk: openai.OpenAI,
                                                                   client: httpx.Client) -> None:
    reasoning, reasoning_content, content, finish = [], [], [], []
    for chunk in sdk.chat.completions.create(model=MODEL, messages=ASK, stream=True):
        [choice] = chunk.choices
        delta: Any = choice.delta
        reasoning.append(getattr(delta, "reasoning", None) or "")
        reasoning_content.append(getattr(delta, "reasoning_content", None) or "")
        content.append(delta.content or "")
        finish.append(choice.finish_reason)
    assert "".join(reasoning) == "".join(reasoning_content) == REASONING
    assert "".join(content) == f"\n\n{ANSWER}"
    assert finish[-1] == "stop"
    first_content = next(i for i, text in enumerate(content) if text)
    assert not any(reasoning[first_content + 1:])  # the reasoning ends before the answer starts


def test_an_answer_cut_while_thinking_is_all_reasoning(sdk: openai.OpenAI, client: httpx.Client) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)  # <think>, Let, " me"
    message: Any = answer.choices[0].message
    assert message.reasoning == "Let me" and message.content is None
    assert answer.choices[0].finish_reason == "length"


def test_thinking_off_gives_the_answer_alone(sdk: openai.OpenAI, client: httpx.Client) -> None:
    answer = sdk.chat.completions.create(model=MODEL, messages=ASK,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message: Any = answer.choices[0].message
    assert message.content == ANSWER and getattr(message, "reasoning", None) is None


def test_the_responses_api_returns_the_thinking_as_a_reasoning_item(sdk: openai.OpenAI,
                                                                    client: httpx.Client) -> None:
    """client.responses.create, whole and streamed (the SDK parses every item and event into its types), and
    the next turn with the output sent back whole, reasoning item included, as the openai-agents SDK does."""
    whole = sdk.responses.create(model=MODEL, input="What is 2+2?")
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == REASONING
    assert message.type == "message" and whole.output_text == f"\n\n{ANSWER}"
    assert whole.usage is not None and 0 < whole.usage.output_tokens_details.reasoning_tokens \
        < whole.usage.output_tokens
    thought, text, kinds = [], [], []
    for event in sdk.responses.create(model=MODEL, input="What is 2+2?", stream=True):
        kinds.append(event.type)
        if event.type == "response.reasoning_text.delta":
            thought.append(event.delta)
        elif event.type == "response.output_text.delta":
            text.append(event.delta)
    assert "".join(thought) == REASONING and "".join(text) == f"\n\n{ANSWER}"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    history: list[Any] = [{"role": "user", "content": "What is 2+2?"},
                          *[item.model_dump(exclude_none=True) for item in whole.output],
                          {"role": "user", "content": "And 3+3?"}]
    follow_up = sdk.responses.create(model=MODEL, input=history)
    assert follow_up.status == "completed" and follow_up.output[0].type == "reasoning"
