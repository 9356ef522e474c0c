"""OpenAI's completions framing of a TextDelta stream: a whole response, or SSE chunks ending in [DONE]
(what both framings share, and the error event of a failed stream: gateway/api/stream_frames.py; chat's:
gateway/api/chat_responses.py).

With n > 1 choices, a stream interleaves the choices' chunks as their tokens come, each with its `index` and
its own finish_reason; a whole response lists them in index order (best_of: the n best, best first).
vLLM's extensions shown here: prompt_logprobs (on each choice, whole responses only), the prompt as echoed
after truncate_prompt_tokens (the tokens the model saw), continuous_usage_stats.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from gateway.api.extensions import prompt_logprobs_k
from gateway.api.logprob_format import (
    CompletionLogprobsBuilder,
    TokenTexts,
    joined,
    vllm_prompt_logprobs,
)
from gateway.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
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
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.requests.service import GatewayService


def echo_text(service: GatewayService, body: CompletionRequest, prepared: PreparedRequest) -> str:
    """The prompt as echoed: the client's own text, or its token ids decoded (and the tokens the model saw
    when truncate_prompt_tokens cut the prompt)."""
    prompt = body.prompts[prepared.batch_index]
    if body.truncate_prompt_tokens is not None:
        prompt = list(prepared.prompt_token_ids)
    return prompt if isinstance(prompt, str) else str(service.tokenizer.decode(list(prompt)))


async def completion_response(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                              prepared: PreparedRequest, deltas: AsyncIterator[TextDelta]
                              ) -> CompletionResponse:
    choices = await Collected.of(deltas)
    lasts = [got.final for got in choices]  # usage counts every choice generated, best_of's too
    if len(choices) > body.n:
        choices = _best(choices, body.n)
    first_index = prepared.batch_index * len(choices)  # a batch's choices: prompt by prompt, as OpenAI's
    # Off the event loop when the prompt was scored: up to MAX_PROMPT_LOGPROB_ENTRIES objects to build.
    return await off_loop_if(prompt_logprobs_k(body) is not None, lambda: CompletionResponse(
        id=prepared.request_id, model=service.model_name, usage=usage_of(prepared, lasts),
        timings=timings_of(lasts),
        choices=[_completion_choice(service, texts, body, prepared, got, first_index + i)
                 for i, got in enumerate(choices)]))


def _best(choices: list[Collected], n: int) -> list[Collected]:
    """best_of: the n choices whose tokens have the highest summed logprob, best first (as vLLM ranks them;
    a tie keeps the lower index first)."""
    return sorted(choices, key=lambda got: -sum(got.logprobs))[:n]


def _completion_choice(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                       prepared: PreparedRequest, got: Collected, index: int) -> CompletionChoice:
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
    prompt_logprobs = None
    if body.prompt_logprobs is not None and got.first is not None:
        prompt_logprobs = vllm_prompt_logprobs(texts, prepared.prompt_token_ids, got.first.prompt_logprobs,
                                               body.prompt_logprobs)
    return CompletionChoice(
        index=index, text=text, finish_reason=got.final.finish_reason, logprobs=logprobs,
        token_ids=got.token_ids if body.return_token_ids else None, prompt_logprobs=prompt_logprobs,
    )


async def completion_stream(service: GatewayService, texts: TokenTexts, body: CompletionRequest,
                            prepared: PreparedRequest, deltas: AsyncIterator[TextDelta], include_usage: bool
                            ) -> AsyncIterator[str]:
    lasts: list[TextDelta] = []  # each choice's final delta
    started: set[int] = set()  # choices with a chunk sent
    errors: list[str] = []
    created = int(time.time())
    frames = [TextFrames(CompletionResponse(
        id=prepared.request_id, model=service.model_name, created=created,
        choices=[CompletionChoice(index=i, text="\x00", finish_reason=None)]), "text")
        for i in range(prepared.sampling.n)]
    running = RunningUsage(prepared, continuous_usage(body))
    is_text_only = (body.logprobs is None and not body.return_token_ids and not body.echo
                    and not running.is_asked)
    builder = CompletionLogprobsBuilder(texts, body.logprobs or 0)
    async for delta in guarded(deltas, errors):
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
                                   choices=[choice], timings=delta.timings, usage=running.after(delta))
        yield sse(chunk.model_dump_json(exclude_none=True))
    for event in errors:
        yield event
    if include_usage and lasts:
        usage = CompletionResponse(id=prepared.request_id, model=service.model_name, created=created,
                                   choices=[], usage=usage_of(prepared, lasts))
        yield sse(usage.model_dump_json(exclude_none=True))
    yield sse("[DONE]")
