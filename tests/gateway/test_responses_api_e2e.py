"""/v1/responses end to end: 1 prefill + 1 decode Ray actor (tiny random Llama with SmolLM2's tokenizer and
ChatML template, float32), read by the unmodified openai SDK and the openai-agents SDK's default model.

The random model writes no tool call of its own: a call is forced with tool_choice (the chat path's grammar
of one call), as tests/gateway/test_structured_outputs.py does; greedy requests give the same tokens whole and
streamed. Every test ends with no KV block held on either worker.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.gateway.conftest import (
    API_KEY,
    MODEL,
    serving,
    two_stage_config,
    wait_until_no_blocks_used,
    whole_after,
)

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["C", "F"]}},
                          "required": ["city", "unit"]}}
FORCED = {"type": "function", "name": "get_weather"}
MAX_TOKENS = 200  # far more than a forced call needs: it ends at the grammar's end
MAX_FUZZ_TOKENS = 4
NUM_FUZZ_EXAMPLES = 60  # per mode


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    # A request that names no max_output_tokens (the fuzzer's) makes few tokens; the key: the fuzzer checks
    # that a request without it is refused.
    config = two_stage_config(tiny_chat_model_dir, decode=1, kv_cache_mib=4, max_num_batched_tokens=128,
                              max_waiting=16, queue_timeout_s=60, default_max_tokens=MAX_FUZZ_TOKENS,
                              api_key=API_KEY)
    with serving(config) as (url, _):
        yield url


@pytest.fixture
def sdk(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:  # the fleet ends whole after each test
        yield c


def test_text_whole_and_streamed_are_the_same_greedy_answer(sdk: openai.OpenAI, client: httpx.Client) -> None:
    ask: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": "Say hello.",
                           "max_output_tokens": 6, "temperature": 0}
    whole = sdk.responses.create(**ask)
    assert whole.status in ("completed", "incomplete") and whole.output[0].type == "message"
    assert (whole.status == "incomplete") == (whole.incomplete_details is not None)
    assert whole.usage is not None and 0 < whole.usage.output_tokens <= 6
    events: list[Any] = list(sdk.responses.create(**ask, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == f"response.{whole.status}"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_client_that_leaves_mid_stream_frees_both_workers(server: str, client: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Tell a long story.", "max_output_tokens": 400, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server, headers=headers, timeout=120) as leaving, \
            leaving.stream("POST", "/v1/responses", json=body) as streamed:
        lines = streamed.iter_lines()
        assert next(lines) == "event: response.created"
        for _ in range(8):  # a few events in, then gone
            next(lines)
    # `client` checks at the end that neither worker still holds a block of it.


def test_a_forced_function_call_whole_streamed_and_its_output_sent_back(sdk: openai.OpenAI,
                                                                         client: httpx.Client) -> None:
    ask: dict[str, Any] = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER],
                           "tool_choice": FORCED, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    first = sdk.responses.create(**ask)
    assert first.status == "completed"
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[arg-type]
    events: list[Any] = list(sdk.responses.create(**ask, stream=True))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(fragments) == done.arguments and json.loads(done.arguments) == json.loads(call.arguments)
    assert events[-1].type == "response.completed"
    # The result goes back as a function_call_output; tool_choice auto (the default): it answers in words.
    second = sdk.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0,  # type: ignore[list-item,unused-ignore]
                                  input=[{"role": "user", "content": "What is the weather in Paris?"},
                                         call.model_dump(exclude_none=True),  # type: ignore[list-item]
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": '{"temperature": 21, "sky": "clear"}'}])
    assert [item.type for item in second.output] == ["message"]
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens


def test_text_format_json_schema_is_held_to_the_schema(sdk: openai.OpenAI, client: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    answer = sdk.responses.create(model=MODEL, input="Yes or no?", max_output_tokens=MAX_TOKENS,
                                  text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                   "strict": True}})
    assert answer.status == "completed"
    jsonschema.validate(json.loads(answer.output_text), schema)


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"extra_body": {"temprature": 0}}, "temprature"),  # a typo is refused, never ignored
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[1].call_id"),
])
def test_bad_requests_are_400s_naming_the_field(sdk: openai.OpenAI, fields: dict[str, Any], param: str
                                                ) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        sdk.responses.create(**{"model": MODEL, "input": "x", "max_output_tokens": 2, **fields})
    assert raised.value.body["param"] == param, raised.value.body  # type: ignore[index]


def test_the_agents_sdk_default_model_runs_a_turn(server: str, client: httpx.Client) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # no traces sent to OpenAI from a test
    cities: list[str] = []

    @agents.function_tool  # an enum: the forced call's string cannot run on to max_tokens
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        cities.append(city)
        return "21 C"

    async def turn(stream: bool) -> Any:
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(
            base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120))
        # Forced, and the run ends with the tool's result: the random model never has to write the answer.
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=model, tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                                                 max_tokens=MAX_TOKENS))
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in streamed.stream_events():
            pass
        return streamed

    assert asyncio.run(turn(stream=False)).final_output == "21 C"
    assert asyncio.run(turn(stream=True)).final_output == "21 C"
    assert len(cities) == 2 and cities[0] == cities[1]  # greedy: the same call both times


def pinned(openapi: dict[str, Any], bound_max_tokens: bool) -> dict[str, Any]:
    """The description with `model` fixed to the served name and, for positive cases, few tokens."""
    pinned = copy.deepcopy(openapi)
    request = pinned["components"]["schemas"]["ResponsesRequest"]
    request["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    for alternative in request["properties"]["input"]["anyOf"]:
        alternative.pop("maxItems", None)  # past it, the body outgrows the limit: a 413 (test_schema_fuzz)
    if bound_max_tokens:
        request["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1,
                                                      "maximum": MAX_FUZZ_TOKENS}
        request["required"] = [*request["required"], "max_output_tokens"]
    return pinned


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzzed_requests_get_documented_answers(server: str, mode: str) -> None:
    """As tests/gateway/test_schema_fuzz.py does for chat: no 5xx, documented statuses and bodies, every error
    in OpenAI's shape with nothing internal in it; and no worker left holding a block."""
    schemathesis = pytest.importorskip("schemathesis")
    from schemathesis import GenerationMode

    from tests.gateway.test_schema_fuzz import fuzz  # here: that module needs schemathesis to import

    openapi = httpx.get(f"{server}/openapi.json").json()
    responses = openapi["paths"]["/v1/responses"]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "415", "429", "503"}
    schema = schemathesis.openapi.from_dict(pinned(openapi, bound_max_tokens=mode == "positive"))
    generation_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE
    fuzz(schema["/v1/responses"]["POST"].as_strategy(generation_mode=generation_mode), server,
         NUM_FUZZ_EXAMPLES)
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        assert client.post("/v1/responses", json={"model": MODEL, "input": "still there?",
                                                  "max_output_tokens": 2}).status_code == 200
        assert wait_until_no_blocks_used(client) == 0
