# Over 300 lines: the chat framing moves to a module of its own once the request extensions (issue 33 item 1)
# have landed here too.
"""OpenAI response framing of a TextDelta stream: whole responses, and SSE chunks ending in [DONE].

A stream that fails after its headers went out (no worker could finish it, a deadline passed) ends with an
OpenAI-shaped error event, `data: {"error": {...}}`, then `data: [DONE]`: never a silent cut.
The chunks of a token (text only: no logprobs, no token ids, not the last one) are framed by _TextFrames
without a pydantic model: they are most of a stream and each costs one json.dumps of its text. Every other
chunk goes through the pydantic models; both spell the same JSON.
With n > 1 choices, a stream interleaves the choices' chunks as their tokens come, each with its `index` and
its own finish_reason; a whole response lists them in index order (completions' best_of: the n best, best
first). Usage counts the prompt once and sums the completion tokens of every choice generated.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from gateway.api.logprob_format import CompletionLogprobsBuilder, TokenTexts, chat_logprobs, joined
from gateway.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from gateway.api.reasoning import ReasoningParser, Split, template_kwargs, with_reasoning
from gateway.api.tool_parsers import ToolCallParser
from gateway.api.tool_responses import ToolCallStream, whole_message
from gateway.requests.events import RequestFailed
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.requests.service import GatewayService
from gateway.telemetry.timings import Timings
from llm_engine import TopLogprobs

logger = logging.getLogger(__name__)


def _usage(prepared: PreparedRequest, lasts: list[TextDelta]) -> Usage:
    """Each choice's final delta in `lasts` (the request's last one carries the cached count)."""
    num_prompt = len(prepared.prompt_token_ids)
    num_output = sum(last.num_output_tokens for last in lasts)
    num_cached = max(last.num_cached_tokens for last in lasts)
    # Only when the prefix cache served part of the prompt (as vLLM, which leaves it out unless asked).
    details = PromptTokensDetails(cached_tokens=num_cached) if num_cached else None
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


class _Collected:
    """One choice's deltas, joined."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.first: TextDelta | None = None
        self.last: TextDelta | None = None

    @classmethod
    async def of(cls, deltas: AsyncIterator[TextDelta]) -> list[_Collected]:
        """Every choice's, in index order."""
        choices: dict[int, _Collected] = {}
        async for delta in deltas:
            collected = choices.setdefault(delta.index, cls())
            collected.first = collected.first or delta
            collected.text.append(delta.text)
            collected.token_ids.extend(delta.token_ids)
            collected.logprobs.extend(delta.logprobs)
            collected.top_logprobs.extend(delta.top_logprobs)
            collected.last = delta
        collected_choices = [choices[index] for index in sorted(choices)]
        assert all(c.last is not None and c.last.finish_reason is not None for c in collected_choices)
        return collected_choices

    @property
    def final(self) -> TextDelta:
        assert self.last is not None
        return self.last


def _timings(lasts: list[TextDelta]) -> Timings | None:
    """The request's timings: on the last of its choices' final deltas."""
    return next((last.timings for last in lasts if last.timings is not None), None)


def echo_text(service: GatewayService, body: CompletionRequest, prepared: PreparedRequest) -> str:
    """The prompt as echoed: the client's own text, or its token ids decoded."""
    prompt = body.prompts[prepared.batch_index]
    return prompt if isinstance(prompt, str) else str(service.tokenizer.decode(list(prompt)))


async def completion_response(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                              prepared: PreparedRequest, deltas: AsyncIterator[TextDelta]
                              ) -> CompletionResponse:
    choices = await _Collected.of(deltas)
    lasts = [got.final for got in choices]  # usage counts every choice generated, best_of's too
    if len(choices) > body.n:
        choices = _best(choices, body.n)
    first_index = prepared.batch_index * len(choices)  # a batch's choices: prompt by prompt, as OpenAI's
    return CompletionResponse(
        id=prepared.request_id, model=service.model_name, usage=_usage(prepared, lasts),
        timings=_timings(lasts),
        choices=[_completion_choice(service, texts, body, prepared, got, first_index + i)
                 for i, got in enumerate(choices)])


def _best(choices: list[_Collected], n: int) -> list[_Collected]:
    """best_of: the n choices whose tokens have the highest summed logprob, best first (as vLLM ranks them;
    a tie keeps the lower index first)."""
    return sorted(choices, key=lambda got: -sum(got.logprobs))[:n]


def _completion_choice(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                       prepared: PreparedRequest, got: _Collected, index: int) -> CompletionChoice:
    text = "".join(got.text)
    logprobs: CompletionLogprobs | None = None
    if body.echo:
        prompt_text = echo_text(service, body, prepared)
        if body.logprobs is not None:
            builder = CompletionLogprobsBuilder(texts, body.logprobs)
            scored = got.first.prompt_logprobs if got.first else None
            logprobs = joined(builder.prompt(prepared.prompt_token_ids, scored),
                              builder.generated(got.token_ids, got.logprobs, got.top_logprobs))
        text = prompt_text + text
    elif body.logprobs is not None:
        logprobs = CompletionLogprobsBuilder(texts, body.logprobs).generated(got.token_ids, got.logprobs,
                                                                             got.top_logprobs)
    return CompletionChoice(
        index=index, text=text, finish_reason=got.final.finish_reason, logprobs=logprobs,
        token_ids=got.token_ids if body.return_token_ids else None,
    )


async def completion_stream(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                            prepared: PreparedRequest, deltas: AsyncIterator[TextDelta], include_usage: bool
                            ) -> AsyncIterator[str]:
    lasts: list[TextDelta] = []  # each choice's final delta
    started: set[int] = set()  # choices with a chunk sent
    errors: list[str] = []
    created = int(time.time())
    frames = [_TextFrames(CompletionResponse(
        id=prepared.request_id, model=service.model_name, created=created,
        choices=[CompletionChoice(index=i, text="\x00", finish_reason=None)]), "text")
        for i in range(prepared.sampling.n)]
    is_text_only = body.logprobs is None and not body.return_token_ids and not body.echo
    builder = CompletionLogprobsBuilder(texts, body.logprobs or 0)
    async for delta in _guarded(deltas, errors):
        is_first = delta.index not in started
        started.add(delta.index)
        if delta.finish_reason is not None:
            lasts.append(delta)
        if is_text_only and delta.finish_reason is None:
            yield frames[delta.index].frame(delta.text)
            continue
        text = delta.text
        logprobs: CompletionLogprobs | None = None
        if body.echo and is_first:
            text = echo_text(service, body, prepared) + text
            if body.logprobs is not None:
                logprobs = builder.prompt(prepared.prompt_token_ids, delta.prompt_logprobs)
        if body.logprobs is not None:
            generated = builder.generated(delta.token_ids, delta.logprobs, delta.top_logprobs)
            logprobs = joined(logprobs, generated) if logprobs else generated
        choice = CompletionChoice(
            index=delta.index, text=text, finish_reason=delta.finish_reason, logprobs=logprobs,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        chunk = CompletionResponse(id=prepared.request_id, model=service.model_name, created=created,
                                   choices=[choice], timings=delta.timings)
        yield _sse(chunk.model_dump_json(exclude_none=True))
    for event in errors:
        yield event
    if include_usage and lasts:
        usage = CompletionResponse(id=prepared.request_id, model=service.model_name, created=created,
                                   choices=[], usage=_usage(prepared, lasts))
        yield _sse(usage.model_dump_json(exclude_none=True))
    yield _sse("[DONE]")


async def chat_response(service: GatewayService, texts: TokenTexts, body: ChatCompletionRequest,
                        prepared: PreparedRequest, deltas: AsyncIterator[TextDelta],
                        tool_parser: ToolCallParser | None = None, reasoning: ReasoningParser | None = None
                        ) -> ChatCompletionResponse:
    """The whole answer, one choice per index; each split into reasoning and content with `reasoning`
    (gateway/api/reasoning.py), and its content read for tool calls with `tool_parser`
    (gateway/api/tool_responses.py)."""
    choices = await _Collected.of(deltas)
    lasts = [got.final for got in choices]
    is_constrained = prepared.sampling.grammar is not None
    starts = reasoning is not None and reasoning.starts_in_reasoning(template_kwargs(body), is_constrained)
    answers = []
    for i, got in enumerate(choices):
        split = Split(None, "".join(got.text))
        if reasoning is not None:
            split = reasoning.split(split.content or "", starts)
        message = ChatDelta(role="assistant", content=split.content)
        finish_reason = got.final.finish_reason
        if tool_parser is not None:
            message, finish_reason = whole_message(tool_parser, split.content or "", finish_reason)
        message = with_reasoning(message, split.reasoning)
        answers.append(ChatChoice(
            index=i, message=message, finish_reason=finish_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(texts, got.token_ids, got.logprobs, got.top_logprobs))
            if body.logprobs else None,
            token_ids=got.token_ids if body.return_token_ids else None,
        ))
    return ChatCompletionResponse(id=prepared.request_id, model=service.model_name, choices=answers,
                                  usage=_usage(prepared, lasts), timings=_timings(lasts))


async def chat_stream(service: GatewayService, texts: TokenTexts, body: ChatCompletionRequest,
                      prepared: PreparedRequest, deltas: AsyncIterator[TextDelta], include_usage: bool,
                      tool_parser: ToolCallParser | None = None, reasoning: ReasoningParser | None = None
                      ) -> AsyncIterator[str]:
    """The SSE chunks, the choices interleaved by index; with `reasoning`, each choice's reasoning apart
    (`delta.reasoning`); with `tool_parser`, each choice's content and tool-call deltas as
    gateway/api/tool_responses.py frames them."""
    created = int(time.time())

    def response(choice: ChatChoice | None, **extra: object) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=prepared.request_id, object="chat.completion.chunk", created=created,
                                      model=service.model_name, choices=[choice] if choice else [],
                                      **extra)  # type: ignore[arg-type]

    def chunk(choice: ChatChoice | None, **extra: object) -> str:
        return _sse(response(choice, **extra).model_dump_json(exclude_none=True))

    num_choices = prepared.sampling.n
    frames = [_TextFrames(response(ChatChoice(index=i, delta=ChatDelta(content="\x00"), finish_reason=None)),
                          "content") for i in range(num_choices)]
    is_text_only = (not body.logprobs and not body.return_token_ids and tool_parser is None
                    and reasoning is None)
    tools = [ToolCallStream(tool_parser) for _ in range(num_choices)] if tool_parser is not None else None
    thoughts = None  # each choice's ReasoningStream: the reasoning is split off before tools read the rest
    if reasoning is not None:
        starts = reasoning.starts_in_reasoning(template_kwargs(body), prepared.sampling.grammar is not None)
        thoughts = [reasoning.stream(starts) for _ in range(num_choices)]
    for i in range(num_choices):  # as OpenAI: each choice's first chunk names the role
        yield chunk(ChatChoice(index=i, delta=ChatDelta(role="assistant", content=""), finish_reason=None))
    lasts: list[TextDelta] = []  # each choice's final delta
    errors: list[str] = []
    async for delta in _guarded(deltas, errors):
        if delta.finish_reason is not None:
            lasts.append(delta)
        if is_text_only and delta.finish_reason is None:
            yield frames[delta.index].frame(delta.text)
            continue
        finish_reason = delta.finish_reason
        thought, text = "", delta.text
        if thoughts is not None:
            thought, text = thoughts[delta.index].feed(text, is_final=finish_reason is not None)
        if tools is not None:
            stream = tools[delta.index]
            pieces = stream.feed(text, is_final=finish_reason is not None)
            finish_reason = stream.finish_reason(finish_reason)
        else:
            pieces = [ChatDelta(content=text)] if text or thoughts is None else []
        if thought:  # the reasoning goes first: it was written before this delta's content
            pieces = [with_reasoning(pieces[0] if pieces else ChatDelta(), thought), *pieces[1:]]
        for piece in pieces[:-1]:
            yield chunk(ChatChoice(index=delta.index, delta=piece, finish_reason=None))
        message = pieces[-1] if pieces else ChatDelta(content="")
        if not pieces and finish_reason is None and not body.logprobs and not body.return_token_ids:
            continue  # held back (it may open a call, or close the reasoning): nothing to send yet
        choice = ChatChoice(
            index=delta.index, delta=message, finish_reason=finish_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(texts, delta.token_ids, delta.logprobs,
                                                        delta.top_logprobs)) if body.logprobs else None,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        yield chunk(choice, timings=delta.timings)
    for event in errors:
        yield event
    if include_usage and lasts:
        yield chunk(None, usage=_usage(prepared, lasts))
    yield _sse("[DONE]")
