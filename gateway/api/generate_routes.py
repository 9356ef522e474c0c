"""The generate routes (behind the API key): POST /v1/completions and POST /v1/chat/completions.

    body (pydantic) → Preparer (tokenized, checked, a request id minted: gateway/api/prepare.py) → admit
    (wait in line, or 429) → the service's stream of deltas → a whole JSON answer or an SSE stream, in the
    endpoint's framing (gateway/api/responses.py). A completion's batch of prompts runs as one request per
    prompt, answered together. A client that leaves aborts its request on both workers.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from gateway.api.auth import require_api_key
from gateway.api.chat_responses import chat_response, chat_stream
from gateway.api.delivery import BoundedStreamingResponse
from gateway.api.disconnect import all_or_none, unless_client_leaves
from gateway.api.errors import documented
from gateway.api.extensions import prompt_logprobs_k
from gateway.api.logprob_format import TokenIdTexts, TokenTexts
from gateway.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from gateway.api.request_id import request_id_of
from gateway.api.responses import completion_response, completion_stream
from gateway.api.stream_frames import off_loop_if
from gateway.requests.prepared import PreparedRequest
from gateway.requests.service import GatewayService
from gateway.telemetry.tracing import trace_headers

router = APIRouter()

# What each kind of route documents beyond its 200 (errors.documented gives OpenAI's error body).
_GENERATE = documented(400, 401, 404, 413, 415, 429, 503)
# With "stream": true: events whose data is a JSON chunk of the 200 model, the last one "[DONE]".
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                         "properties": {"data": {"type": "string"}}}}}


def traced(service: GatewayService, prepared: PreparedRequest, request: Request) -> PreparedRequest:
    """The request with its HTTP request's W3C trace context, when traces are sent."""
    if service.tracer is None:
        return prepared
    return dataclasses.replace(prepared, trace_headers=trace_headers(request.headers))


def token_texts(body: CompletionRequest | ChatCompletionRequest, request: Request) -> TokenTexts:
    """How logprobs name tokens: by their text, or by "token_id:<id>" (vLLM's return_tokens_as_token_ids)."""
    return TokenIdTexts() if body.return_tokens_as_token_ids else request.app.state.token_texts


async def respond(service: GatewayService, body: CompletionRequest | ChatCompletionRequest,
                  prepared: PreparedRequest, request: Request) -> Response:
    """Admit, then answer whole or as an SSE stream, in the framing of the request's endpoint.

    Until the response starts, a client that leaves is noticed (it leaves the admission line, a whole
    response's generation is aborted); once an SSE stream runs, Starlette notices it and closes the
    stream, which aborts the request on both workers.
    """
    # Watching for the client's disconnect costs two tasks: only worth it when the request must wait.
    reservation = service.try_admit(prepared)
    if reservation is None:
        reservation = await unless_client_leaves(request, service.admit(prepared))
    deltas = service.stream(prepared, reservation)
    texts = token_texts(body, request)
    is_chat = isinstance(body, ChatCompletionRequest)
    # Chat with tools: the answer is read for tool calls in the model's format; with --reasoning-parser,
    # after the reasoning is split off.
    preparer = request.app.state.preparer
    tools: dict[str, object] = {"tool_parser": preparer.tool_parser} if prepared.parses_tool_calls else {}
    if is_chat and preparer.reasoning_parser is not None:
        tools["reasoning"] = preparer.reasoning_parser
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        framing = chat_stream if is_chat else completion_stream
        stream = framing(service, texts, body, prepared, deltas, include_usage, **tools)  # type: ignore[arg-type]
        return BoundedStreamingResponse(
            stream, service.send_by(prepared, reservation), service.metrics.stalled_streams.inc,
            media_type="text/event-stream", background=BackgroundTask(reservation.release_at_stream_end))
    whole = chat_response if is_chat else completion_response
    try:
        answer = whole(service, texts, body, prepared, deltas, **tools)  # type: ignore[arg-type]
        response = await unless_client_leaves(request, answer)
    finally:
        await deltas.aclose()  # aborts both workers unless the request finished
    return await off_loop_if(prompt_logprobs_k(body) is not None,
                             lambda: JSONResponse(response.model_dump(exclude_none=True)))

async def respond_batch(service: GatewayService, body: CompletionRequest, batch: list[PreparedRequest],
                        request: Request) -> Response:
    """A batch of prompts (not streamed): each runs as a request of its own, concurrently; one response
    with a choice per prompt (`index` in prompt order) and the usage summed."""
    texts = token_texts(body, request)

    async def one(prepared: PreparedRequest) -> CompletionResponse:
        reservation = service.try_admit(prepared) or await service.admit(prepared)  # its own priority
        deltas = service.stream(prepared, reservation)
        try:
            return await completion_response(service, texts, body, prepared, deltas)
        finally:
            await deltas.aclose()  # aborts both workers unless the request finished

    answers = await unless_client_leaves(request, all_or_none([one(p) for p in batch]))
    usages = [a.usage for a in answers if a.usage is not None]
    usage = Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                  completion_tokens=sum(u.completion_tokens for u in usages),
                  total_tokens=sum(u.total_tokens for u in usages))
    whole = CompletionResponse(id=batch[0].request_id, model=service.model_name,
                               choices=[c for a in answers for c in a.choices], usage=usage)
    return JSONResponse(whole.model_dump(exclude_none=True))


@router.post("/v1/completions", dependencies=[Depends(require_api_key)],
             responses={200: {"model": CompletionResponse, "content": _SSE}, **_GENERATE})
async def completions(body: CompletionRequest, request: Request) -> Response:
    service: GatewayService = request.app.state.service
    batch = await request.app.state.preparer.prepare_completion(body, request_id_of(request.state))
    batch = [traced(service, prepared, request) for prepared in batch]
    if len(batch) == 1:
        return await respond(service, body, batch[0], request)
    return await respond_batch(service, body, batch, request)


@router.post("/v1/chat/completions", dependencies=[Depends(require_api_key)],
             responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_GENERATE})
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    service: GatewayService = request.app.state.service
    prepared = await request.app.state.preparer.prepare_chat(body, request_id_of(request.state))
    return await respond(service, body, traced(service, prepared, request), request)
