"""OpenAI response framing of a TextDelta stream: whole responses, and SSE chunks ending in [DONE].

A stream that fails after its headers went out (no worker could finish it, a deadline passed) ends with an
OpenAI-shaped error event, `data: {"error": {...}}`, then `data: [DONE]`: never a silent cut.
The chunks of a token (text only: no logprobs, no token ids, not the last one) are framed by _TextFrames
without a pydantic model: they are most of a stream and each costs one json.dumps of its text. Every other
chunk goes through the pydantic models; both spell the same JSON.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from gateway.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from gateway.requests.orchestrator import RequestFailed
from gateway.requests.service import GatewayService, PreparedRequest, TextDelta

logger = logging.getLogger(__name__)


def _usage(prepared: PreparedRequest, last: TextDelta) -> Usage:
    num_prompt = len(prepared.prompt_token_ids)
    num_output = last.num_output_tokens
    # Only when the prefix cache served part of the prompt (as vLLM, which leaves it out unless asked).
    details = PromptTokensDetails(cached_tokens=last.num_cached_tokens) if last.num_cached_tokens else None
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output,
                 prompt_tokens_details=details)


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class _TextFrames:
    """One stream's text-only chunks: the JSON around the text is rendered once per stream."""

    def __init__(self, first: ChatCompletionResponse | CompletionResponse, text_field: str) -> None:
        # The chunk of a marker text, cut around the marker's JSON: what comes before and after any text.
        marker = "\x00"
        rendered = _sse(first.model_dump_json(exclude_none=True))
        head, tail = rendered.split(json.dumps(marker))
        assert f'"{text_field}":' in head[-len(text_field) - 3 :], "the text is the chunk's last field"
        self._head, self._tail = head, tail

    def frame(self, text: str) -> str:
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._tail}"


async def _guarded(deltas: AsyncIterator[TextDelta], errors: list[str]) -> AsyncIterator[TextDelta]:
    """The deltas until the stream fails; then the failure's error event lands in `errors`."""
    try:
        async for delta in deltas:
            yield delta
    except RequestFailed as failed:
        errors.append(_error_event(str(failed), failed.code))
    except Exception:  # never a silent cut, never internals in the body
        logger.exception("a stream failed")
        errors.append(_error_event("the server failed while generating this response", "internal_error"))


def _error_event(message: str, code: str) -> str:
    body = ErrorResponse(error=ErrorBody(message=message, type="server_error", code=code))
    return _sse(body.model_dump_json())


async def _collect(deltas: AsyncIterator[TextDelta]) -> tuple[str, list[int], list[float], TextDelta]:
    text: list[str] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    last: TextDelta | None = None
    async for delta in deltas:
        text.append(delta.text)
        token_ids.extend(delta.token_ids)
        logprobs.extend(delta.logprobs)
        last = delta
    assert last is not None and last.finish_reason is not None
    return "".join(text), token_ids, logprobs, last


def _completion_logprobs(service: GatewayService, token_ids: list[int], logprobs: list[float]
                         ) -> dict[str, list[float | str]]:
    tokens: list[float | str] = [str(service.tokenizer.convert_ids_to_tokens(t)) for t in token_ids]
    return {"tokens": tokens, "token_logprobs": list(logprobs)}


def _chat_logprobs(service: GatewayService, token_ids: list[int], logprobs: list[float]
                   ) -> dict[str, list[dict[str, float | str]]]:
    return {"content": [{"token": str(service.tokenizer.convert_ids_to_tokens(t)), "logprob": lp}
                        for t, lp in zip(token_ids, logprobs, strict=False)]}


async def completion_response(service: GatewayService, body: CompletionRequest, prepared: PreparedRequest,
                              deltas: AsyncIterator[TextDelta]) -> CompletionResponse:
    text, token_ids, logprobs, last = await _collect(deltas)
    choice = CompletionChoice(
        text=text, finish_reason=last.finish_reason,
        logprobs=_completion_logprobs(service, token_ids, logprobs) if body.logprobs is not None else None,
        token_ids=token_ids if body.return_token_ids else None,
    )
    return CompletionResponse(id=prepared.request_id, model=service.model_name, choices=[choice],
                              usage=_usage(prepared, last), timings=last.timings)


async def completion_stream(service: GatewayService, body: CompletionRequest, prepared: PreparedRequest,
                            deltas: AsyncIterator[TextDelta], include_usage: bool) -> AsyncIterator[str]:
    last: TextDelta | None = None
    errors: list[str] = []
    created = int(time.time())
    frames = _TextFrames(CompletionResponse(
        id=prepared.request_id, model=service.model_name, created=created,
        choices=[CompletionChoice(text="\x00", finish_reason=None)]), "text")
    is_text_only = body.logprobs is None and not body.return_token_ids
    async for delta in _guarded(deltas, errors):
        last = delta
        if is_text_only and delta.finish_reason is None:
            yield frames.frame(delta.text)
            continue
        choice = CompletionChoice(
            text=delta.text, finish_reason=delta.finish_reason,
            logprobs=_completion_logprobs(service, list(delta.token_ids), list(delta.logprobs))
            if body.logprobs is not None else None,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        chunk = CompletionResponse(id=prepared.request_id, model=service.model_name, created=created,
                                   choices=[choice], timings=delta.timings)
        yield _sse(chunk.model_dump_json(exclude_none=True))
    for event in errors:
        yield event
    if include_usage and last is not None:
        usage = CompletionResponse(id=prepared.request_id, model=service.model_name, created=created,
                                   choices=[], usage=_usage(prepared, last))
        yield _sse(usage.model_dump_json(exclude_none=True))
    yield _sse("[DONE]")


async def chat_response(service: GatewayService, body: ChatCompletionRequest, prepared: PreparedRequest,
                        deltas: AsyncIterator[TextDelta]) -> ChatCompletionResponse:
    text, token_ids, logprobs, last = await _collect(deltas)
    choice = ChatChoice(
        message=ChatDelta(role="assistant", content=text), finish_reason=last.finish_reason,
        logprobs=_chat_logprobs(service, token_ids, logprobs) if body.logprobs else None,
        token_ids=token_ids if body.return_token_ids else None,
    )
    return ChatCompletionResponse(id=prepared.request_id, model=service.model_name, choices=[choice],
                                  usage=_usage(prepared, last), timings=last.timings)


async def chat_stream(service: GatewayService, body: ChatCompletionRequest, prepared: PreparedRequest,
                      deltas: AsyncIterator[TextDelta], include_usage: bool) -> AsyncIterator[str]:
    created = int(time.time())

    def response(choice: ChatChoice | None, **extra: object) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=prepared.request_id, object="chat.completion.chunk", created=created,
                                      model=service.model_name, choices=[choice] if choice else [],
                                      **extra)  # type: ignore[arg-type]

    def chunk(choice: ChatChoice | None, **extra: object) -> str:
        return _sse(response(choice, **extra).model_dump_json(exclude_none=True))

    frames = _TextFrames(response(ChatChoice(delta=ChatDelta(content="\x00"), finish_reason=None)), "content")
    is_text_only = not body.logprobs and not body.return_token_ids
    yield chunk(ChatChoice(delta=ChatDelta(role="assistant", content=""), finish_reason=None))
    last: TextDelta | None = None
    errors: list[str] = []
    async for delta in _guarded(deltas, errors):
        last = delta
        if is_text_only and delta.finish_reason is None:
            yield frames.frame(delta.text)
            continue
        choice = ChatChoice(
            delta=ChatDelta(content=delta.text), finish_reason=delta.finish_reason,
            logprobs=_chat_logprobs(service, list(delta.token_ids), list(delta.logprobs))
            if body.logprobs else None,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        yield chunk(choice, timings=delta.timings)
    for event in errors:
        yield event
    if include_usage and last is not None:
        yield chunk(None, usage=_usage(prepared, last))
    yield _sse("[DONE]")
