"""Open-loop sending: each request leaves at its arrival time, whatever the server's state, and streams.

Per request it records when each token arrived (client clock), the usage, any error, and the server's
stage timings when the server returns them (pdserve does, in the final chunk). A request goes to
/v1/completions (a prompt of token ids or text) or /v1/chat/completions (one user message of text).
The stream is read as Server-Sent Events by httpx-sse, so `data:` without a space, a payload split over
several `data:` lines and `:` comment lines (keep-alive pings) read as the SSE specification says.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
from httpx_sse import SSEError, aconnect_sse

from loadgen.workload import RequestSpec

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class RequestOptions:
    """How each request is sent, as `vllm bench serve` sends it: a field left None is not sent (the server's
    default holds); `extra_body` is merged into every body last, so it overrides anything above."""

    endpoint: str = "/v1/completions"  # one of ENDPOINTS
    ignore_eos: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)  # a JSON object from --extra-body

    def sampling(self) -> dict[str, Any]:
        """The sampling fields that were set, by their request-body names."""
        fields = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                  "min_p": self.min_p, "frequency_penalty": self.frequency_penalty,
                  "presence_penalty": self.presence_penalty, "repetition_penalty": self.repetition_penalty}
        return {name: value for name, value in fields.items() if value is not None}


# What the benchmark scripts send: greedy, exactly max_tokens tokens (lengths as planned).
PINNED = RequestOptions(ignore_eos=True, temperature=0.0)


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float  # planned arrival, seconds after the run started
    sent_s: float  # when it actually left
    input_len: int
    output_len: int  # max_tokens asked for
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival of each token, relative to sent_s
    num_output_tokens: int = 0
    status: int = 0  # HTTP status; 0 if the connection failed
    error: str = ""
    timings: dict[str, Any] | None = None  # the server's stage timings, when it returns them

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft_s is None or self.e2e_s is None or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_json(self) -> str:
        data = asdict(self)
        data["itls_s"] = self.itls_s
        data["tpot_s"] = self.tpot_s
        return json.dumps(data)


def request_body(spec: RequestSpec, model: str, options: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Token ids per chunk, so that a chunk carrying several tokens counts as several (vLLM knows it too).
        "return_token_ids": True,
    }
    if options.endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": spec.prompt_text or ""}]
    else:
        body["prompt"] = spec.prompt_text if spec.prompt_text is not None else list(spec.prompt_token_ids)
    if options.ignore_eos is not None:
        body["ignore_eos"] = options.ignore_eos
    return body | options.sampling() | options.extra_body


async def send_one(client: httpx.AsyncClient, spec: RequestSpec, model: str, start: float,
                   options: RequestOptions = PINNED) -> RequestRecord:
    await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
    return await send_now(client, spec, model, start, options)


async def send_now(client: httpx.AsyncClient, spec: RequestSpec, model: str, start: float,
                   options: RequestOptions = PINNED) -> RequestRecord:
    """Send one request at once and stream its answer; `start` is the run's clock origin."""
    sent = time.perf_counter()
    record = RequestRecord(
        spec.index, spec.arrival_s, sent - start, len(spec.prompt_token_ids), spec.output_len
    )
    body = request_body(spec, model, options)
    try:
        async with aconnect_sse(client, "POST", options.endpoint, json=body) as events:
            response = events.response
            record.status = response.status_code
            if response.status_code != 200:
                record.error = (await response.aread()).decode(errors="replace")[:500]
                return record
            async for event in events.aiter_sse():
                if event.data in ("", "[DONE]"):  # an event with no data (`event:`/`id:` only); the end
                    continue
                chunk = json.loads(event.data)
                now = time.perf_counter() - sent
                if chunk.get("usage"):  # the server's count: text prompts have no length here before
                    record.num_output_tokens = chunk["usage"]["completion_tokens"]
                    record.input_len = chunk["usage"].get("prompt_tokens") or record.input_len
                if chunk.get("timings"):
                    record.timings = chunk["timings"]
                if chunk.get("error"):
                    record.error = str(chunk["error"].get("message", chunk["error"]))[:500]
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                num_tokens = len(choice.get("token_ids") or ()) or (1 if text else 0)
                if num_tokens:
                    record.token_times_s.extend([now] * num_tokens)
                    if record.ttft_s is None:
                        record.ttft_s = now
            record.e2e_s = time.perf_counter() - sent
    except (httpx.HTTPError, SSEError, json.JSONDecodeError) as error:  # SSEError: not an event stream
        record.error = f"{type(error).__name__}: {error}"
    return record
