"""The request path's two boundary types: PreparedRequest in (made by gateway/api/prepare.py from an OpenAI
request), TextDelta out (framed by gateway/api/responses.py as a JSON answer or SSE chunks)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.telemetry.timings import Timings
from llm_engine.params import PromptLogprobs, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class PreparedRequest:
    """A request the HTTP edge has tokenized and checked, ready for admission (GatewayService.admit)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_strings: list[str]
    arrival: float  # time.time() when the gateway received it
    block_hashes: list[bytes] | None = None  # prefix_hashes of the prompt (the router's cache matching)
    # max_tokens 0 (completions: score the prompt): the one token the engine samples is not shown.
    is_prompt_only: bool = False
    batch_index: int = 0  # its prompt's place in a completions batch (the choice's index)
    parses_tool_calls: bool = False  # chat with tools: the output is read for tool calls
    trace_headers: tuple[tuple[str, str], ...] = ()  # W3C traceparent/tracestate of its HTTP request
    priority: int = 0  # its place in the admission line: lower first, then arrival (vLLM's priority)
    # How its text is made (vLLM's fields): special tokens left out; the stop string (or stop token) kept.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(frozen=True)
class TextDelta:
    """New text of one choice (GatewayService.stream); the last of a choice carries its finish and counts."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None
    num_output_tokens: int = 0  # tokens generated so far
    timings: Timings | None = None  # on the last delta
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (on the last delta)
    top_logprobs: tuple[TopLogprobs, ...] = ()  # per token, when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None  # on the first delta, when sampling.prompt_logprobs
    index: int = 0  # the choice (sampling.n > 1)
