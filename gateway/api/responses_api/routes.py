"""POST /v1/responses (behind the API key), served by the chat path:

    body (ResponsesRequest) → fields checked (protocol.NOT_SUPPORTED: a 400 naming each) → a chat request
    (mapping.to_chat) → the Preparer's prepare_chat (template, tools, grammar, context: its 400s renamed for
    this request) → admit (wait in line, or 429) → the service's stream of deltas through both stages →
    ResponseWriter → a whole response object, or SSE events (`event: <type>`, `data: <JSON>`; no [DONE], as
    OpenAI). A client that leaves aborts its request on both workers, as on chat.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.background import BackgroundTask

from gateway.api.auth import require_api_key
from gateway.api.bad_request import BadRequest
from gateway.api.delivery import BoundedStreamingResponse
from gateway.api.disconnect import unless_client_leaves
from gateway.api.errors import documented
from gateway.api.generate_routes import traced
from gateway.api.request_id import request_id_of
from gateway.api.responses_api.mapping import check_supported, in_responses_terms, to_chat
from gateway.api.responses_api.objects import ResponseObject, sse
from gateway.api.responses_api.protocol import ResponsesRequest
from gateway.api.responses_api.writer import ResponseWriter
from gateway.requests.events import RequestFailed
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.requests.service import GatewayService

logger = logging.getLogger(__name__)

router = APIRouter()

# With "stream": true: typed events, each `event: <type>` + `data: <JSON>` (objects.py's models).
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["event", "data"],
                                         "properties": {"event": {"type": "string"},
                                                        "data": {"type": "string"}}}}}


@router.post("/v1/responses", dependencies=[Depends(require_api_key)],
             responses={200: {"model": ResponseObject, "content": _SSE},
                        **documented(400, 401, 404, 413, 415, 429, 503)})
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    service: GatewayService = request.app.state.service
    preparer = request.app.state.preparer
    check_supported(body)
    chat = to_chat(body, preparer.model_name)
    try:
        prepared = await preparer.prepare_chat(chat.request, request_id_of(request.state))
    except BadRequest as error:
        raise in_responses_terms(error, chat.origins) from None
    prepared = traced(service, prepared, request)
    # As on chat: watching for the client's disconnect costs two tasks, only worth it when it must wait.
    reservation = service.try_admit(prepared)
    if reservation is None:
        reservation = await unless_client_leaves(request, service.admit(prepared))
    deltas = service.stream(prepared, reservation)
    reasoning = preparer.reasoning_parser
    # As on chat: a grammar from the first token (text.format, a forced call) leaves no room to think.
    thoughts = (reasoning.stream(reasoning.starts_in_reasoning(None, prepared.sampling.grammar is not None))
                if reasoning is not None else None)
    writer = ResponseWriter(_in_progress(body, prepared, service.model_name), len(prepared.prompt_token_ids),
                            preparer.tool_parser if prepared.parses_tool_calls else None, thoughts)
    if body.stream:
        return BoundedStreamingResponse(
            _events(writer, deltas), service.send_by(prepared, reservation),
            service.metrics.stalled_streams.inc, media_type="text/event-stream",
            background=BackgroundTask(reservation.release_at_stream_end))
    try:
        whole = await unless_client_leaves(request, _whole(writer, deltas))
    finally:
        await deltas.aclose()  # aborts both workers unless the request finished
    return JSONResponse(whole.model_dump(mode="json"))


def _in_progress(body: ResponsesRequest, prepared: PreparedRequest, model_name: str) -> ResponseObject:
    """The response before any output: the request's settings as applied (the sampler's values)."""
    tool_choice = body.tool_choice or ("auto" if body.tools else "none")
    return ResponseObject(
        id=prepared.request_id, status="in_progress", model=model_name, instructions=body.instructions,
        max_output_tokens=prepared.sampling.max_tokens, temperature=prepared.sampling.temperature,
        top_p=prepared.sampling.top_p,
        tools=[t.model_dump(mode="json", exclude_none=True) for t in body.tools or []],
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(mode="json"),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text=body.text.model_dump(mode="json", by_alias=True, exclude_none=True)
        if body.text and body.text.format else {"format": {"type": "text"}},
        metadata=body.metadata or {})


async def _whole(writer: ResponseWriter, deltas: AsyncIterator[TextDelta]) -> ResponseObject:
    async for delta in deltas:  # a failure raises: the error handlers answer it (503 and its reason)
        writer.feed(delta)
    return writer.response


async def _events(writer: ResponseWriter, deltas: AsyncGenerator[TextDelta, None]) -> AsyncIterator[str]:
    try:
        for event in writer.start():
            yield sse(event)
        async for delta in deltas:
            for event in writer.feed(delta):
                yield sse(event)
    except RequestFailed as failed:  # the headers are gone: the failure is the stream's last events
        for event in writer.fail(str(failed), failed.code):
            yield sse(event)
    except Exception:  # never a silent cut, never internals in the body
        logger.exception("a responses stream failed")
        for event in writer.fail("the server failed while generating this response", "internal_error"):
            yield sse(event)
    finally:
        # A client gone mid-stream closes this generator: the request is aborted on both workers now, not
        # when the garbage collector finalizes `deltas`.
        await deltas.aclose()
