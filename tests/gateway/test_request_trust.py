"""What a request may ask of a shared server, checked where requests are prepared (no server): a priority
only where the server schedules by it, alternatives per token within --max-logprobs, and a cache salt that
goes with the request to the workers and salts the block hashes the router matches."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from gateway.api import prepare
from gateway.api.bad_request import BadRequest
from gateway.api.prepare import Preparer
from gateway.api.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from llm_engine.kv_cache_manager import chain_root, prefix_hashes
from llm_engine.model_files import load_tokenizer, read_model_spec
from tests.helpers.servers import MODEL


def preparer(model_dir: Path, **settings: Any) -> Preparer:
    return Preparer(load_tokenizer(model_dir), read_model_spec(model_dir), MODEL, 4096, 16, 16, **settings)


def refused(preparer: Preparer, request: CompletionRequest | ChatCompletionRequest) -> BadRequest:
    prepare = (preparer.prepare_completion(request) if isinstance(request, CompletionRequest)
               else preparer.prepare_chat(request))
    with pytest.raises(BadRequest) as raised:
        asyncio.run(prepare)
    return raised.value


def test_a_priority_is_refused_unless_the_server_schedules_by_priority(tiny_chat_model_dir: Path) -> None:
    request = CompletionRequest(model=MODEL, prompt="hi", max_tokens=2, priority=-3)
    error = refused(preparer(tiny_chat_model_dir), request)
    assert error.param == "priority" and "--scheduling-policy" in str(error)
    by_priority = preparer(tiny_chat_model_dir, priority_scheduling=True)
    [prepared] = asyncio.run(by_priority.prepare_completion(request))
    assert prepared.priority == -3


def test_prompt_logprobs_over_a_long_prompt_are_bounded(tiny_chat_model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review LOW: positions × (k + 1) entries, each a Python object on the worker and in the response."""
    monkeypatch.setattr(prepare, "MAX_PROMPT_LOGPROB_ENTRIES", 100)  # the tiny model's context is short
    error = refused(preparer(tiny_chat_model_dir), CompletionRequest(
        model=MODEL, prompt=list(range(100, 140)), prompt_logprobs=2, max_tokens=1))
    assert error.param == "prompt_logprobs" and "120 entries" in str(error)
    asyncio.run(preparer(tiny_chat_model_dir).prepare_completion(CompletionRequest(
        model=MODEL, prompt=list(range(100, 133)), prompt_logprobs=2, max_tokens=1)))  # 99: served


def test_alternatives_per_token_are_capped_by_max_logprobs(tiny_chat_model_dir: Path) -> None:
    capped = preparer(tiny_chat_model_dir, max_logprobs=2)
    assert refused(capped, CompletionRequest(model=MODEL, prompt="hi", logprobs=3)).param == "logprobs"
    messages = [ChatMessage(role="user", content="hi")]
    chat = ChatCompletionRequest(model=MODEL, messages=messages, logprobs=True, top_logprobs=3)
    assert refused(capped, chat).param == "top_logprobs"
    prompt_scores = CompletionRequest(model=MODEL, prompt="hi", prompt_logprobs=5)
    assert refused(capped, prompt_scores).param == "prompt_logprobs"
    [within] = asyncio.run(capped.prepare_completion(CompletionRequest(model=MODEL, prompt="hi", logprobs=2)))
    assert within.sampling.top_logprobs == 2


def test_a_cache_salt_goes_with_the_request_and_salts_its_block_hashes(tiny_chat_model_dir: Path) -> None:
    prompt = list(range(100, 140))
    [salted] = asyncio.run(preparer(tiny_chat_model_dir).prepare_completion(
        CompletionRequest(model=MODEL, prompt=prompt, cache_salt="tenant-a")))
    [plain] = asyncio.run(preparer(tiny_chat_model_dir).prepare_completion(
        CompletionRequest(model=MODEL, prompt=prompt)))
    assert salted.sampling.cache_salt == "tenant-a" and plain.sampling.cache_salt is None
    assert salted.block_hashes == prefix_hashes(prompt, 16, chain_root("tenant-a"))
    assert plain.block_hashes == prefix_hashes(prompt, 16) and not set(salted.block_hashes or ()) & set(
        plain.block_hashes or ())
