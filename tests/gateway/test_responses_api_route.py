"""/v1/responses' route without Ray: a real Preparer (SmolLM2's tokenizer and template on the tiny model) and
a scripted service in place of the workers, read back by the unmodified openai SDK and the openai-agents SDK's
default model. The same through both stages on Ray: tests/gateway/test_responses_api_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api.auth import require_api_key
from gateway.api.errors import install_error_handlers
from gateway.api.prepare import Preparer
from gateway.api.protocol import ChatCompletionRequest
from gateway.api.responses_api.routes import router
from gateway.requests.events import RequestFailed
from gateway.requests.prepared import PreparedRequest, TextDelta
from llm_engine.model_loader import load_tokenizer, read_model_spec
from tests.gateway.test_responses_api import CALL_TEXT, MODEL, WEATHER, delta

# The route, with a scripted service in place of the fleet.

class ScriptedService:
    """What the route uses of GatewayService; answers every request with `text`, cut into 4-char deltas."""

    model_name = MODEL
    tracer = None
    metrics = SimpleNamespace(stalled_streams=SimpleNamespace(inc=lambda: None))

    def __init__(self) -> None:
        self.text = "Hello there."
        self.finish_reason = "stop"
        self.failure: RequestFailed | None = None
        self.prepared: list[PreparedRequest] = []

    def try_admit(self, prepared: PreparedRequest) -> object:
        return SimpleNamespace(release_at_stream_end=lambda: None)

    def send_by(self, prepared: PreparedRequest, reservation: object) -> float:
        return time.time() + 60

    async def stream(self, prepared: PreparedRequest, reservation: object) -> AsyncIterator[TextDelta]:
        self.prepared.append(prepared)
        pieces = [self.text[i:i + 4] for i in range(0, len(self.text), 4)] or [""]
        for i, piece in enumerate(pieces):
            if self.failure is not None and i == 1:
                raise self.failure
            is_last = i == len(pieces) - 1
            yield delta(piece, self.finish_reason if is_last else None, num_output_tokens=i + 1)


@pytest.fixture(scope="module")
def app(tiny_chat_model_dir: Path) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(router)
    app.dependency_overrides[require_api_key] = lambda: None
    app.state.service = ScriptedService()
    app.state.preparer = Preparer(load_tokenizer(str(tiny_chat_model_dir)),
                                  read_model_spec(str(tiny_chat_model_dir)), MODEL, 4096, 16, 16)
    return app


@pytest.fixture
def service(app: FastAPI) -> ScriptedService:
    app.state.service.__init__()
    return app.state.service  # type: ignore[no-any-return]


@pytest.fixture
def sdk(app: FastAPI) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                         http_client=TestClient(app))


def test_the_sdk_reads_a_whole_and_a_streamed_response(sdk: openai.OpenAI, service: ScriptedService) -> None:
    whole = sdk.responses.create(model=MODEL, input="Say hello.", instructions="Be kind.",
                                 max_output_tokens=9)
    assert whole.status == "completed" and whole.output_text == "Hello there."
    assert whole.usage is not None and whole.usage.output_tokens == 3 and whole.instructions == "Be kind."
    assert whole.max_output_tokens == 9 and whole.id == service.prepared[0].request_id
    events: list[Any] = list(sdk.responses.create(model=MODEL, input="Say hello.", stream=True))
    assert type(events[0]).__name__ == "ResponseCreatedEvent"
    assert type(events[-1]).__name__ == "ResponseCompletedEvent"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hello there."
    assert events[-1].response.output_text == "Hello there."


def test_the_sdks_stream_helper_applies_every_event(sdk: openai.OpenAI, service: ScriptedService) -> None:
    """responses.stream() applies each event to a snapshot (an item per output_index, a part per
    content_index, deltas appended to them): an event naming the wrong item or part raises there."""
    service.text = "Let me look.\n" + CALL_TEXT
    with sdk.responses.stream(model=MODEL, input="Weather?", tools=[WEATHER]) as stream:  # type: ignore[list-item]
        rebuilt = stream.get_final_response()
    message, call = rebuilt.output
    assert message.type == "message" and message.content[0].text.strip() == "Let me look."  # type: ignore[union-attr]
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}


def test_a_forced_call_then_its_output_with_the_sdk(sdk: openai.OpenAI, service: ScriptedService, app: FastAPI
                                                    ) -> None:
    service.text = CALL_TEXT
    first = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
                                 tool_choice={"type": "function", "name": "get_weather"})
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert service.prepared[0].sampling.grammar is not None  # forced: the grammar of one call
    service.text = "It is 21 C."
    second = sdk.responses.create(model=MODEL, tools=[WEATHER], input=[  # type: ignore[list-item]
        {"role": "user", "content": "Weather in Paris?"}, *[item.model_dump(exclude_none=True)
                                                           for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}])
    assert second.output_text == "It is 21 C."
    rendered = app.state.preparer.tokenizer.decode(list(service.prepared[1].prompt_token_ids))
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered
    assert '"name": "get_weather"' in rendered  # the earlier call, written in the parser's format


@pytest.mark.parametrize(("tool_choice", "is_forced", "is_read"), [
    ("required", True, True), ("auto", False, True), ("none", False, False)])
def test_tool_choice_plans_the_chat_path(sdk: openai.OpenAI, service: ScriptedService, tool_choice: str,
                                         is_forced: bool, is_read: bool) -> None:
    """required: a grammar of one call; auto: the output is read for calls; none: plain text."""
    service.text = CALL_TEXT
    answer = sdk.responses.create(model=MODEL, input="x", tools=[WEATHER], tool_choice=tool_choice)  # type: ignore[arg-type,list-item]
    [prepared] = service.prepared
    assert (prepared.sampling.grammar is not None, prepared.parses_tool_calls) == (is_forced, is_read)
    assert [item.type for item in answer.output] == (["function_call"] if is_read else ["message"])
    assert answer.tool_choice == tool_choice


def test_a_length_cut_and_a_failure_mid_stream(sdk: openai.OpenAI, service: ScriptedService) -> None:
    service.finish_reason = "length"
    cut = sdk.responses.create(model=MODEL, input="x", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    service.failure = RequestFailed("no worker could finish the request", "worker_failed")
    events = list(sdk.responses.create(model=MODEL, input="x", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    with pytest.raises(openai.APIStatusError) as raised:  # whole: before any byte went out, a 503
        sdk.responses.create(model=MODEL, input="x")
    assert raised.value.status_code == 503


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": "x"},
                {"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[1].call_id"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_stock"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "frob"}}}}, "text.format"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
    ({"tools": [{**WEATHER, "parameters": "x"}]}, "tools[0].parameters"),
    ({"model": "other"}, "model"),
])
def test_bad_requests_are_400s_in_openais_shape_naming_the_field(
        sdk: openai.OpenAI, fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "input": "x", **fields}
    with pytest.raises(openai.APIStatusError) as raised:
        sdk.responses.create(**body)
    error = raised.value.body
    assert raised.value.status_code == (404 if param == "model" else 400), error
    assert isinstance(error, dict) and error["param"] == param, error
    assert error["type"] in ("invalid_request_error", "not_found_error") and error["message"]


def test_the_agents_sdk_default_model_runs_a_turn(app: FastAPI, service: ScriptedService) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    service.text = CALL_TEXT
    seen: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        seen.append(city)
        return "21 C"

    async def turn(stream: bool) -> Any:
        client = openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app)))
        agent = agents.Agent(name="weather", instructions="Answer with the weather.", tools=[get_weather],
                             model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                             model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=64),
                             tool_use_behavior="stop_on_first_tool")
        if not stream:
            return await agents.Runner.run(agent, "Weather in Paris?")
        streamed = agents.Runner.run_streamed(agent, "Weather in Paris?")
        async for _ in streamed.stream_events():
            pass
        return streamed

    for stream in (False, True):
        result = asyncio.run(turn(stream))
        assert result.final_output == "21 C"
    assert seen == ["Paris", "Paris"]


def test_a_chat_validation_error_names_the_whole_path() -> None:
    """The error handler keeps every request model's field names: nested tool fields included."""
    chat = FastAPI()
    install_error_handlers(chat)

    @chat.post("/chat")
    async def echo(body: ChatCompletionRequest) -> dict[str, str]:
        return {}

    tool = {"type": "function", "function": {"name": "f", "parameters": "x"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [tool]}
    error = TestClient(chat).post("/chat", json=body).json()["error"]
    assert error["param"] == "tools[0].function.parameters"
