"""OpenAI's chat framing of a TextDelta stream: a whole response, or SSE chunks ending in [DONE] (what both
framings share: gateway/api/stream_frames.py).

With n > 1 choices, a stream interleaves the choices' chunks as their tokens come, each with its `index`; a
whole response lists them in index order. With a reasoning parser, each choice's thinking is split off into
`reasoning` (gateway/api/reasoning.py) before its content is read for tool calls
(gateway/api/tool_responses.py). vLLM's extensions shown here: `echo` (the answer starts with the last
message's content: in the whole message, or in each choice's first chunk), prompt_logprobs (on the whole
response), continuous_usage_stats.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.api.extensions import echoed_message, prompt_logprobs_k
from gateway.api.logprob_format import TokenTexts, chat_logprobs, vllm_prompt_logprobs
from gateway.api.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
)
from gateway.api.reasoning import ReasoningParser, Split, with_reasoning
from gateway.api.stream_frames import (
    Collected,
    RunningUsage,
    TextFrames,
    continuous_usage,
    guarded,
    off_loop_if,
    sse,
    timings_of,
    usage_of,
)
from gateway.api.tool_parsers import ToolCallParser
from gateway.api.tool_responses import ToolCallStream, whole_message
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.requests.service import GatewayService


async def chat_response(service: GatewayService, texts: TokenTexts, body: ChatCompletionRequest,
                        prepared: PreparedRequest, deltas: AsyncIterator[TextDelta],
                        tool_parser: ToolCallParser | None = None, reasoning: ReasoningParser | None = None
                        ) -> ChatCompletionResponse:
    """The whole answer, one choice per index; each split into reasoning and content with `reasoning`, and
    its content read for tool calls with `tool_parser`. Rendered off the event loop when the prompt was
    scored (prompt_logprobs: up to MAX_PROMPT_LOGPROB_ENTRIES objects)."""
    choices = await Collected.of(deltas)
    return await off_loop_if(prompt_logprobs_k(body) is not None, lambda: _chat_answer(
        service, texts, body, prepared, choices, tool_parser, reasoning))


def _chat_answer(service: GatewayService, texts: TokenTexts, body: ChatCompletionRequest,
                 prepared: PreparedRequest, choices: list[Collected], tool_parser: ToolCallParser | None,
                 reasoning: ReasoningParser | None) -> ChatCompletionResponse:
    lasts = [got.final for got in choices]
    echoed = echoed_message(body)
    starts = reasoning is not None and reasoning.starts_in_reasoning(body.chat_template_kwargs,
                                                                     prepared.sampling.grammar is not None)
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
        if echoed:
            message = message.model_copy(update={"content": echoed + (message.content or "")})
        answers.append(ChatChoice(
            index=i, message=message, finish_reason=finish_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(texts, got.token_ids, got.logprobs, got.top_logprobs))
            if body.logprobs else None,
            token_ids=got.token_ids if body.return_token_ids else None,
        ))
    prompt_logprobs = None
    if body.prompt_logprobs is not None and choices and choices[0].first is not None:
        prompt_logprobs = vllm_prompt_logprobs(texts, prepared.prompt_token_ids,
                                               choices[0].first.prompt_logprobs, body.prompt_logprobs)
    return ChatCompletionResponse(id=prepared.request_id, model=service.model_name, choices=answers,
                                  usage=usage_of(prepared, lasts), timings=timings_of(lasts),
                                  prompt_logprobs=prompt_logprobs)


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
        return sse(response(choice, **extra).model_dump_json(exclude_none=True))

    num_choices = prepared.sampling.n
    frames = [TextFrames(response(ChatChoice(index=i, delta=ChatDelta(content="\x00"), finish_reason=None)),
                         "content") for i in range(num_choices)]
    running = RunningUsage(prepared, continuous_usage(body))
    is_text_only = (not body.logprobs and not body.return_token_ids and tool_parser is None
                    and reasoning is None and not running.is_asked)
    tools = [ToolCallStream(tool_parser) for _ in range(num_choices)] if tool_parser is not None else None
    thoughts = None  # each choice's ReasoningStream: the reasoning is split off before tools read the rest
    if reasoning is not None:
        is_constrained = prepared.sampling.grammar is not None
        starts = reasoning.starts_in_reasoning(body.chat_template_kwargs, is_constrained)
        thoughts = [reasoning.stream(starts) for _ in range(num_choices)]
    echoed = echoed_message(body)
    for i in range(num_choices):  # as OpenAI: each choice's first chunk names the role (and echo's text)
        first = ChatDelta(role="assistant", content=echoed)
        yield chunk(ChatChoice(index=i, delta=first, finish_reason=None))
    lasts: list[TextDelta] = []  # each choice's final delta
    errors: list[str] = []
    async for delta in guarded(deltas, errors):
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
        if (not pieces and finish_reason is None and not body.logprobs and not body.return_token_ids
                and not running.is_asked):
            continue  # held back (it may open a call, or close the reasoning): nothing to send yet
        choice = ChatChoice(
            index=delta.index, delta=message, finish_reason=finish_reason,
            logprobs=ChatLogprobs(content=chat_logprobs(texts, delta.token_ids, delta.logprobs,
                                                        delta.top_logprobs)) if body.logprobs else None,
            token_ids=list(delta.token_ids) if body.return_token_ids else None,
        )
        yield chunk(choice, timings=delta.timings, usage=running.after(delta))
    for event in errors:
        yield event
    if include_usage and lasts:
        yield chunk(None, usage=usage_of(prepared, lasts))
    yield sse("[DONE]")
