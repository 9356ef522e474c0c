"""What the OpenAI framings share (gateway/api/responses.py for completions, gateway/api/chat_responses.py for
chat): usage, SSE events, the fast text-only chunk, the error event that ends a failed stream, a choice's
deltas joined for a whole response, and the rendering of a whole response whose prompt was scored off the
event loop (off_loop_if: prompt_logprobs make up to MAX_PROMPT_LOGPROB_ENTRIES objects, seconds of Python
that every other request on the frontend would wait behind).

A stream that fails after its headers went out (no worker could finish it, a deadline passed) ends with an
OpenAI-shaped error event, `data: {"error": {...}}`, then `data: [DONE]`: never a silent cut.
The chunks of a token (text only: no logprobs, no token ids, not the last one) are framed by TextFrames
without a pydantic model: they are most of a stream and each costs one json.dumps of its text. Every other
chunk goes through the pydantic models; both spell the same JSON.
Usage counts the prompt once and sums the completion tokens of every choice generated; with vLLM's
stream_options.continuous_usage_stats every chunk carries the usage so far (RunningUsage).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from gateway.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorBody,
    ErrorResponse,
    PromptTokensDetails,
    Usage,
)
from gateway.requests.events import RequestFailed
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.telemetry.timings import Timings
from llm_engine.params import TopLogprobs

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def off_loop_if(is_heavy: bool, render: Callable[[], T]) -> T:
    """render() in a thread when it is heavy (the loop then only switches to it), else here."""
    return await asyncio.to_thread(render) if is_heavy else render()


def usage_of(prepared: PreparedRequest, lasts: list[TextDelta]) -> Usage:
    """Each choice's final delta in `lasts` (the request's last one carries the cached count)."""
    num_prompt = len(prepared.prompt_token_ids)
    num_output = sum(last.num_output_tokens for last in lasts)
    num_cached = max(last.num_cached_tokens for last in lasts)
    # Only when the prefix cache served part of the prompt (as vLLM, which leaves it out unless asked).
    details = PromptTokensDetails(cached_tokens=num_cached) if num_cached else None
    return Usage(prompt_tokens=num_prompt, completion_tokens=num_output, total_tokens=num_prompt + num_output,
                 prompt_tokens_details=details)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class TextFrames:
    """One stream's text-only chunks: the JSON around the text is rendered once per stream."""

    def __init__(self, first: ChatCompletionResponse | CompletionResponse, text_field: str) -> None:
        # The chunk of a marker text, cut around the marker's JSON: what comes before and after any text.
        marker = "\x00"
        rendered = sse(first.model_dump_json(exclude_none=True))
        head, tail = rendered.split(json.dumps(marker))
        if f'"{text_field}":' not in head[-len(text_field) - 3 :]:  # a check that survives python -O
            raise ValueError(f"the text ({text_field}) must be the chunk's last field")
        self._head, self._tail = head, tail

    def frame(self, text: str) -> str:
        return f"{self._head}{json.dumps(text, ensure_ascii=False)}{self._tail}"


async def guarded(deltas: AsyncIterator[TextDelta], errors: list[str]) -> AsyncIterator[TextDelta]:
    """The deltas until the stream fails; then the failure's error event lands in `errors`."""
    try:
        async for delta in deltas:
            yield delta
    except RequestFailed as failed:
        errors.append(error_event(str(failed), failed.code))
    except Exception:  # never a silent cut, never internals in the body
        logger.exception("a stream failed")
        errors.append(error_event("the server failed while generating this response", "internal_error"))


def error_event(message: str, code: str) -> str:
    body = ErrorResponse(error=ErrorBody(message=message, type="server_error", code=code))
    return sse(body.model_dump_json())


class Collected:
    """One choice's deltas, joined."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[TopLogprobs] = []
        self.first: TextDelta | None = None
        self.last: TextDelta | None = None

    @classmethod
    async def of(cls, deltas: AsyncIterator[TextDelta]) -> list[Collected]:
        """Every choice's, in index order."""
        choices: dict[int, Collected] = {}
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


def timings_of(lasts: list[TextDelta]) -> Timings | None:
    """The request's timings: on the last of its choices' final deltas."""
    return next((last.timings for last in lasts if last.timings is not None), None)




class RunningUsage:
    """vLLM's continuous_usage_stats: the usage so far, for every chunk of a stream (None when not asked)."""

    def __init__(self, prepared: PreparedRequest, is_asked: bool) -> None:
        self.num_prompt = len(prepared.prompt_token_ids)
        self.is_asked = is_asked
        self._num_output: dict[int, int] = {}  # choice → its tokens so far

    def after(self, delta: TextDelta) -> Usage | None:
        if not self.is_asked:
            return None
        self._num_output[delta.index] = delta.num_output_tokens
        num_output = sum(self._num_output.values())
        return Usage(prompt_tokens=self.num_prompt, completion_tokens=num_output,
                     total_tokens=self.num_prompt + num_output)


def continuous_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)
