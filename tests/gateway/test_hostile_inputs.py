"""Hostile and malformed requests: each gets the right 4xx in OpenAI's error shape, and afterwards the server
still serves a normal request and holds no KV block."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api.prepare import LONG_PROMPT_TOKENS, Preparer
from gateway.api.protocol import ChatCompletionRequest, ChatMessage
from llm_engine.model_files import load_tokenizer, read_model_spec
from tests.helpers.servers import MODEL, wait_until_no_blocks_used

VOCAB_SIZE = 49152  # the tiny chat model's (SmolLM2's tokenizer)
JSON = {"content-type": "application/json"}


def assert_error(response: httpx.Response, status: int, needle: str, param: str | None = None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert needle.lower() in body["error"]["message"].lower(), body
    assert body["error"]["type"] == ("invalid_request_error" if status != 404 else "not_found_error")
    if param is not None:
        assert body["error"]["param"] == param, body


@pytest.fixture
def still_serving(client: httpx.Client) -> Iterator[None]:
    """After the test: a normal request is served, and every KV block is free again."""
    yield
    normal = {"model": MODEL, "prompt": "still there?", "max_tokens": 2}
    response = client.post("/v1/completions", json=normal)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2
    assert wait_until_no_blocks_used(client) == 0


pytestmark = pytest.mark.usefixtures("still_serving")


def test_a_ten_megabyte_body_gets_413(client: httpx.Client) -> None:
    body = json.dumps({"model": MODEL, "prompt": "a" * (10 << 20)})
    assert_error(client.post("/v1/completions", content=body, headers=JSON), 413, "larger than")


def test_a_ten_megabyte_chunked_body_gets_413(client: httpx.Client) -> None:
    # No Content-Length: the server counts the bytes as they arrive.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(10):
            yield b"a" * (1 << 20)
        yield b'"}'

    assert_error(client.post("/v1/completions", content=chunks(), headers=JSON), 413, "larger than")


def test_deeply_nested_json_gets_400(client: httpx.Client) -> None:
    deep = '{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    assert_error(client.post("/v1/completions", content=deep, headers=JSON), 400, "nested too deeply")
    nested = {"model": MODEL, "prompt": [[[[[[[[1]]]]]]]]}
    # A batch of token-id lists is a valid prompt: the error names the innermost bad item.
    assert_error(client.post("/v1/completions", json=nested), 400, "prompt", param="prompt[0][0]")


def test_deep_json_in_an_unknown_field_gets_400_naming_it(client: httpx.Client) -> None:
    body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "extra": ' + "[" * 500 + "]" * 500 + "}"
    assert_error(client.post("/v1/completions", content=body, headers=JSON), 400, "unknown field",
                 param="extra")


def test_invalid_utf8_gets_400(client: httpx.Client) -> None:
    body = b'{"model": "tiny", "prompt": "\xff\xfe\xc3("}'
    assert_error(client.post("/v1/completions", content=body, headers=JSON), 400, "not valid UTF-8")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_gets_400(client: httpx.Client, route: str) -> None:
    # Valid JSON ("\ud800" is a legal escape), but no character: the tokenizer cannot take it.
    if route == "/v1/completions":
        body, param = '{"model": "tiny", "prompt": "ab\\ud800"}', "prompt"
    else:
        body = '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}'
        param = "messages[0].content"
    assert_error(client.post(route, content=body, headers=JSON), 400, "unicode", param=param)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1), ("max_tokens", 10**30), ("max_tokens", 2.5),
        ("max_tokens", "8"), ("max_tokens", True),
        ("temperature", -0.5), ("temperature", 2.0001), ("temperature", 1e308), ("temperature", "hot"),
        ("top_p", 0), ("top_p", -1), ("top_p", 1.5),
        ("top_k", -2), ("top_k", 10**30),
        ("seed", 2**64), ("seed", -(2**63) - 1), ("seed", 1.5),
        ("logprobs", -1), ("logprobs", 21), ("logprobs", 10**30),
        ("n", 0), ("n", 17),
    ],
)
def test_bad_numbers_get_400_naming_the_field(client: httpx.Client, field: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, field: value}
    assert_error(client.post("/v1/completions", json=body), 400, "", param=field)


@pytest.mark.parametrize(
    "raw", ['"max_tokens": 1e400', '"temperature": NaN', '"top_p": Infinity', '"max_tokens": ' + "9" * 5000]
)
def test_numbers_json_cannot_hold_get_400(client: httpx.Client, raw: str) -> None:
    body = '{"model": "tiny", "prompt": "x", ' + raw + "}"
    assert_error(client.post("/v1/completions", content=body, headers=JSON), 400, "")


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1e-300), ("top_p", 1e-300), ("seed", -(2**63)), ("seed", 2**64 - 1), ("top_k", -1),
     ("top_k", 2**31 - 1)],
)
def test_extreme_but_valid_numbers_are_served(client: httpx.Client, field: str, value: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, field: value}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 3


def test_a_hundred_thousand_stop_strings_get_400_naming_stop(client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "x", "stop": [f"s{i}" for i in range(100_000)]}
    assert_error(client.post("/v1/completions", json=body), 400, "at most 16 stop strings", param="stop")
    long_stop = {"model": MODEL, "prompt": "x", "stop": "s" * 10_000}
    assert_error(client.post("/v1/completions", json=long_stop), 400, "at most 256 characters", param="stop")


@pytest.mark.parametrize(
    ("endpoint", "extra", "param", "needle"),
    [
        ("chat", {"functions": [{"name": "f"}]}, "functions", "not supported yet"),
        ("chat", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
                  "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
         "no function"),
        ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "frob"}}}}, "response_format", "cannot use this schema"),
        ("completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$ref": "#/nowhere"}}}}, "response_format", "cannot use this schema"),
        ("chat", {"n": 17}, "n", "16"),
        ("chat", {"top_logprobs": 21, "logprobs": True}, "top_logprobs", "20"),
        ("chat", {"top_logprobs": 3}, "top_logprobs", "logprobs: true"),
        ("completions", {"best_of": 3, "stream": True}, "best_of", "stream"),
        ("completions", {"best_of": 2, "n": 3}, "best_of", "at least n"),
        ("completions", {"suffix": "x"}, "suffix", "not supported"),
        ("completions", {"logprobs": 21}, "logprobs", "20"),
        ("completions", {"frobnicate": 1}, "frobnicate", "unknown field"),
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ("completions", {"logit_bias": {"50": 101}}, "logit_bias", "100"),
        ("completions", {"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias", "vocabulary"),
        # More digits than int() converts (4300): was a ValueError outside the checks, a 500.
        ("completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias", "token ids"),
        ("chat", {"logit_bias": {"1" * 5000: 1}}, "logit_bias", "token ids"),
        ("completions", {"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids", "vocabulary"),
        ("completions", {"min_tokens": 5, "max_tokens": 2}, "min_tokens", "exceeds max_tokens"),
        ("completions", {"presence_penalty": 2.5}, "presence_penalty", "2"),
    ],
)
def test_fields_pdserve_cannot_honour_get_400_naming_them(
        client: httpx.Client, endpoint: str, extra: dict[str, Any], param: str, needle: str) -> None:
    """Nothing is dropped in silence: a field whose effect pdserve cannot honour, or does not know, is a 400
    that names it (the review of 2026-12-01 found `tools`, `response_format`, `logit_bias` and the penalties
    accepted and ignored)."""
    if endpoint == "chat":
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **extra}
    else:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, **extra}
    assert_error(client.post(f"/v1/{'chat/' if endpoint == 'chat' else ''}completions", json=body), 400,
                 needle, param=param)


def test_a_tool_message_without_a_matching_call_gets_400_naming_it(client: httpx.Client) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c2", "content": "42"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    assert_error(client.post("/v1/chat/completions", json=body), 400, "no earlier assistant message",
                 param="messages[2].tool_call_id")


def test_fields_ignored_by_design_and_values_that_ask_nothing_are_served(client: httpx.Client) -> None:
    """user, metadata and store change nothing by design (docs/api.md); n: 1, tools: [], response_format text
    and the like ask for nothing, so they are served."""
    harmless = {"user": "u-1", "metadata": {"a": "b"}, "store": False, "n": 1}
    completion = {"model": MODEL, "prompt": "x", "max_tokens": 2, "suffix": None, "echo": False, "best_of": 1,
                  **harmless}
    assert client.post("/v1/completions", json=completion).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": "me"}], "max_tokens": 2,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, **harmless}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_not_sent_as_json_gets_415(client: httpx.Client, content_type: str | None) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 2}).encode()
    request = client.build_request("POST", "/v1/completions", content=body)
    if content_type is None:
        request.headers.pop("content-type", None)
    else:
        request.headers["content-type"] = content_type
    response = client.send(request)
    assert response.status_code == 415, response.text
    assert "application/json" in response.json()["error"]["message"]
    # A JSON media type with parameters, or a +json one, is JSON.
    for json_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        answer = client.post("/v1/completions", content=body, headers={"content-type": json_type})
        assert answer.status_code == 200, (json_type, answer.text)


@pytest.mark.parametrize("content", [b"", b"null", b"[]", b"5", b'"prompt"'])
def test_an_empty_or_non_object_body_gets_400(client: httpx.Client, content: bytes) -> None:
    assert_error(client.post("/v1/completions", content=content, headers=JSON), 400, "JSON object")


@pytest.mark.parametrize("prompt", [[-1], [VOCAB_SIZE], [5, 2**70], ""])
def test_bad_prompts_get_400_naming_prompt(client: httpx.Client, prompt: object) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert_error(response, 400, "", param="prompt")


def test_an_empty_messages_list_gets_400(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert_error(response, 400, "at least 1", param="messages")


def test_unsupported_message_parts_get_400(client: httpx.Client) -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [image]}]}
    assert_error(client.post("/v1/chat/completions", json=body), 400, "", param="messages[0].content[0].type")
    wrong_role = {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}
    assert_error(client.post("/v1/chat/completions", json=wrong_role), 400, "", param="messages[0].role")


def test_unknown_routes_and_methods_get_openai_errors(client: httpx.Client) -> None:
    missing = client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong_method = client.get("/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["message"]


@pytest.mark.parametrize("stop", ["", [""], ["", ""]])
def test_an_empty_stop_string_stops_nothing(client: httpx.Client, stop: object) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "ignore_eos": True, "stop": stop}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "length"


def test_too_many_messages_get_400_naming_messages(client: httpx.Client) -> None:
    many = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * 1025  # 2050 messages
    response = client.post("/v1/chat/completions", json={"model": MODEL, "messages": many, "max_tokens": 1})
    assert_error(response, 400, "at most 2048", param="messages")


def test_a_conversation_of_many_short_messages_is_rendered_off_the_event_loop(
        tiny_chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    preparer = Preparer(tokenizer, read_model_spec(str(tiny_chat_model_dir)), MODEL, 4096, 16, 16)
    rendered_on: list[str] = []
    render = tokenizer.apply_chat_template

    def spy(*args: Any, **kwargs: Any) -> Any:
        rendered_on.append(threading.current_thread().name)
        return render(*args, **kwargs)

    tokenizer.apply_chat_template = spy
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content="ok")] * 20
    body = ChatCompletionRequest(model=MODEL, messages=messages, max_tokens=1)
    prepared = asyncio.run(preparer.prepare_chat(body))
    assert len(prepared.prompt_token_ids) > 40
    assert rendered_on and rendered_on[0].startswith("prompt-prep"), rendered_on


def test_tokenize_and_detokenize_refuse_oversized_input_naming_the_field(client: httpx.Client) -> None:
    # 1 MiB of text and 256k ids (a long context's worth): more is only work for the gateway.
    too_long = {"model": MODEL, "prompt": "a" * ((1 << 20) + 1)}
    assert_error(client.post("/tokenize", json=too_long), 400, "at most 1048576", param="prompt")
    half = "a" * (1 << 19)
    messages = [{"role": "user", "content": half}, {"role": "assistant", "content": half},
                {"role": "user", "content": [{"type": "text", "text": "a"}]}]
    response = client.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert_error(response, 400, "at most 1048576", param="messages")
    too_many = {"model": MODEL, "tokens": [0] * ((1 << 18) + 1)}
    assert_error(client.post("/detokenize", json=too_many), 400, "at most 262144", param="tokens")


def test_long_text_is_tokenized_and_long_ids_decoded_off_the_event_loop(tiny_chat_model_dir: Path) -> None:
    """/tokenize and /detokenize (gateway/api/utility_routes.py) go through these, as requests do."""
    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    preparer = Preparer(tokenizer, read_model_spec(str(tiny_chat_model_dir)), MODEL, 4096, 16, 16)
    ran_on: list[str] = []

    def recorded(work: Callable[..., Any]) -> Callable[..., Any]:
        def spy(*args: Any) -> Any:
            ran_on.append(threading.current_thread().name)
            return work(*args)
        return spy

    preparer._encode = recorded(preparer._encode)
    tokenizer.decode = recorded(tokenizer.decode)
    text = "The quick brown fox. " * 500  # past LONG_PROMPT_CHARS
    tokens = asyncio.run(preparer.encode(text))
    assert tokens == tokenizer.encode(text) and len(tokens) > LONG_PROMPT_TOKENS
    assert asyncio.run(preparer.decode(tokens)) == text
    assert asyncio.run(preparer.encode("short")) == tokenizer.encode("short")
    assert [name.startswith("prompt-prep") for name in ran_on] == [True, True, False], ran_on


def test_a_requests_grammar_is_checked_off_the_event_loop(tiny_chat_model_dir: Path) -> None:
    """Review LOW (event-loop work left from N1): the grammar engine checks a schema in milliseconds when it
    is large; a burst of them held the frontend's event loop. Checked on the prompt thread now."""
    from gateway.api import structured

    tokenizer = load_tokenizer(str(tiny_chat_model_dir))
    preparer = Preparer(tokenizer, read_model_spec(str(tiny_chat_model_dir)), MODEL, 4096, 16, 16)
    checked_on: list[str] = []
    check = structured.check_grammar

    def spy(spec: Any) -> None:
        checked_on.append(threading.current_thread().name)
        check(spec)

    structured.check_grammar = spy  # type: ignore[assignment]
    try:
        schema = {"type": "object", "properties": {"only_here": {"type": "integer"}}}
        body = ChatCompletionRequest(model=MODEL, messages=[ChatMessage(role="user", content="hi")],
                                     response_format={"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": schema}})
        asyncio.run(preparer.prepare_chat(body))
    finally:
        structured.check_grammar = check  # type: ignore[assignment]
    assert checked_on and checked_on[0].startswith("prompt-prep"), checked_on
