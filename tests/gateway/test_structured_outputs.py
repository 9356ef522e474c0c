"""Structured outputs and tool calls through the real two-stage path (1 prefill + 2 decode Ray actors, tiny
random Llama with SmolLM2's tokenizer and ChatML template, float32), with the openai SDK.

The prefill worker samples the first token under the grammar and the decode worker rebuilds the matcher from
it, so every `json_schema` answer parses, validates (jsonschema) and ends at the grammar's end (finish_reason
stop), whatever the random weights; across a forced migration the third worker replays the tokens so far and
the seeded stream equals the engine alone. Tool calls: a forced call (named, required) is parsed into
`tool_calls`, whole and streamed (id/type/name first, then argument fragments), and the second turn sends the
result back as a `tool` message. Bad input is a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llm_engine import SamplingParams
from llm_engine.structured import GrammarSpec
from tests.helpers import two_stage_server
from tests.helpers.engines import make_engine
from tests.helpers.forced_migration import stream_across_a_failure
from tests.helpers.servers import MODEL
from tests.helpers.structured_schemas import SCHEMAS

EOS = 2  # the tokenizer's <|im_end|>: the tiny model's config names none, so the gateway adds it
MAX_TOKENS = 400  # far more than any of SCHEMAS' documents needs: each must end at the grammar's end
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


# The shared two-stage server's fixtures (tests/helpers/two_stage_server.py), by the names the tests ask for.
server, sdk, client = two_stage_server.shared_two_stage_server, two_stage_server.sdk, two_stage_server.client


def schema_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_every_json_schema_answer_parses_validates_and_ends_at_the_grammar_end(
        sdk: openai.OpenAI, client: httpx.Client) -> None:
    def ask(item: tuple[int, tuple[str, dict[str, Any]]]) -> tuple[str, Any, str | None]:
        i, (name, schema) = item
        answer = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe #{i} as JSON."}],
            max_tokens=MAX_TOKENS, temperature=1.0, seed=i, response_format=schema_format(name, schema))  # type: ignore[arg-type]
        return name, answer.choices[0].message.content, answer.choices[0].finish_reason

    with ThreadPoolExecutor(4) as pool:  # several at once: masks of a batch's rows, on both stages
        answers = list(pool.map(ask, enumerate(SCHEMAS.items())))
    assert len(answers) >= 20
    for name, content, finish_reason in answers:
        assert finish_reason == "stop", (name, content)
        jsonschema.validate(json.loads(content), SCHEMAS[name])


def test_json_object_on_both_endpoints_and_a_streamed_schema(sdk: openai.OpenAI, client: httpx.Client
                                                              ) -> None:
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                       max_tokens=MAX_TOKENS, temperature=0,
                                       response_format={"type": "json_object"})
    # A random model in a free object may write until max_tokens; what it wrote follows the grammar.
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    else:
        assert (chat.choices[0].message.content or "").startswith("{")
    body = {"model": MODEL, "prompt": "Data:", "max_tokens": MAX_TOKENS, "temperature": 0,
            "response_format": schema_format("p", SCHEMAS["nested"])}
    completion = client.post("/v1/completions", json=body).json()["choices"][0]
    assert completion["finish_reason"] == "stop"
    jsonschema.validate(json.loads(completion["text"]), SCHEMAS["nested"])
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],  # type: ignore[arg-type]
                                         stream=True,
                                         max_tokens=MAX_TOKENS, temperature=0,
                                         response_format=schema_format("a", SCHEMAS["array_of_objects"]))  # type: ignore[arg-type]
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS["array_of_objects"])


def test_a_forced_tool_call_round_trip_with_the_sdk(sdk: openai.OpenAI, client: httpx.Client) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = sdk.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=MAX_TOKENS, temperature=0,  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "clear"}'}]
    # tool_choice auto (the default with tools): this random model answers in words.
    second = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], max_tokens=8,  # type: ignore[list-item]
                                         temperature=0)
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_required_calls_one_of_the_tools_and_streams_openai_deltas(sdk: openai.OpenAI, client: httpx.Client
                                                                   ) -> None:
    messages = [{"role": "user", "content": "Time or weather?"}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME],  # type: ignore[arg-type, list-item]
                                        tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    [call] = whole.choices[0].message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time") and whole.choices[0].message.content is None
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, TIME], stream=True,  # type: ignore[arg-type, list-item]
                                         tool_choice="required", max_tokens=MAX_TOKENS, temperature=0)
    pieces, finish_reasons = [], []
    for chunk in stream:
        if chunk.choices:
            pieces += chunk.choices[0].delta.tool_calls or []
            finish_reasons.append(chunk.choices[0].finish_reason)
    assert finish_reasons[-1] == "tool_calls"
    head, *fragments = pieces
    assert head.id and head.type == "function" and head.function and head.function.name == call.function.name
    assert all(p.index == 0 and p.id is None and p.function and p.function.name is None for p in fragments)
    arguments = "".join(p.function.arguments or "" for p in pieces if p.function)
    assert json.loads(arguments) == json.loads(call.function.arguments)  # greedy: the same call


def test_bad_tool_and_schema_input_is_a_400_naming_the_field(sdk: openai.OpenAI) -> None:
    user = [{"role": "user", "content": "x"}]
    cases: list[tuple[str, dict[str, Any]]] = [
        ("response_format", {"messages": user, "response_format": schema_format("x", {"type": "frob"})}),
        ("tool_choice", {"messages": user, "tools": [WEATHER],
                         "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}),
        ("messages[1].tool_call_id", {"messages": [*user, {"role": "tool", "tool_call_id": "call_x",
                                                          "content": "42"}]}),
    ]
    for param, fields in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.chat.completions.create(model=MODEL, max_tokens=2, **fields)
        assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]


def test_a_structured_stream_survives_a_forced_migration(client: httpx.Client, tiny_chat_model_dir: Path
                                                         ) -> None:
    """The decode worker fails mid-document: the other one replays prompt + tokens so far into a new matcher
    and goes on; the seeded stream equals the engine alone's and the document is valid. Last in the module."""
    schema = SCHEMAS["many_fields"]
    body = {"model": MODEL, "prompt": "Fields:", "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 5,
            "response_format": schema_format("m", schema)}
    tokens, moves = stream_across_a_failure(client, body)
    assert moves == [1]
    token_ids = tokens[0]
    prompt = client.post("/tokenize", json={"model": MODEL, "prompt": "Fields:"}).json()["tokens"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5, stop_token_ids=(EOS,),
                            grammar=GrammarSpec.of_schema(schema))
    [alone] = make_engine(tiny_chat_model_dir).generate([prompt], params)
    assert token_ids == list(alone.output_token_ids)
    assert token_ids[-1] == EOS  # ended at the grammar's end
    text = client.post("/detokenize", json={"tokens": token_ids[:-1]}).json()["prompt"]
    jsonschema.validate(json.loads(text), schema)
