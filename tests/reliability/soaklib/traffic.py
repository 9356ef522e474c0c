"""What the soak sends and how: the request mix, its client-side cancellations, one SoakRecord per request.

The mix builds on loadgen/ (RequestSpec and Poisson arrivals from workload.py, RequestRecord
from client.py). A request's outcome, set once it ends:
  pending → ok         the response or stream finished with a finish_reason (and [DONE] for a stream)
          → cancelled  the client left on purpose: before the first token, after N tokens, or gave up
          → error      an HTTP error, an error chunk, a stream cut short, a transport failure
          → hung       still open --hang-after s after it left; closed by the client
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from loadgen.client import RequestRecord
from loadgen.workload import RequestSpec, poisson_arrivals
from tests.reliability.soaklib.config import SoakConfig

# Prompt text for chat requests: common words, about one token each with SmolLM2's tokenizer.
_WORDS_TEXT = """
the of and to in is that it for on with as was by at be this from or have an are not but which one all were
we when there can their has more if no out so what up about into than them time some could these two may
first then do any like my now over such our man me even most made after also did many before must through
back years where much your way well down should because each just those people how too little state good
very make world still own see men work long get here between both life being under never day same another
know while last might us great old year off come since against go came right used take three
"""
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class SoakSpec:
    request: RequestSpec  # arrival, prompt token ids (completions), max_tokens
    phase: str  # "warmup" or "soak"
    endpoint: str  # "completions" or "chat"
    is_stream: bool
    cancel: str  # "none", "before_first_token", "after_tokens" (streams), "give_up" (whole responses)
    cancel_after_tokens: int  # "after_tokens": close the stream once this many tokens arrived
    cancel_after_s: float  # "give_up": close the connection after this long
    ignore_eos: bool
    temperature: float


def build_specs(config: SoakConfig, vocab_size: int, max_model_len: int) -> list[SoakSpec]:
    rng = random.Random(config.seed)
    total_s = config.warmup_s + config.duration_s
    count = int(config.rate * total_s * 2) + 20
    arrivals = [t for t in poisson_arrivals(config.rate, count, rng) if t < total_s]
    specs = []
    for index, arrival in enumerate(arrivals):
        num_in = rng.randint(4, 64) if rng.random() < 0.7 else rng.randint(256, 640)
        num_out = rng.randint(1, 32) if rng.random() < 0.6 else rng.randint(64, 256)
        num_in = max(1, min(num_in, max_model_len - num_out - 32))  # room for the chat template
        is_stream = rng.random() < 0.75
        cancel, after_tokens, after_s = "none", 0, 0.0
        if rng.random() < config.cancel_fraction:
            if not is_stream:
                cancel, after_s = "give_up", rng.uniform(0.0, 3.0)
            elif rng.random() < 0.3 or num_out < 2:
                cancel = "before_first_token"
            else:
                cancel, after_tokens = "after_tokens", rng.randint(1, num_out - 1)
        prompt = tuple(rng.randrange(vocab_size) for _ in range(num_in))
        specs.append(SoakSpec(RequestSpec(index, arrival, prompt, num_out),
                              "warmup" if arrival < config.warmup_s else "soak",
                              "chat" if rng.random() < 0.5 else "completions", is_stream, cancel,
                              after_tokens, after_s, rng.random() < 0.8, rng.choice((0.0, 0.8))))
    return specs


def request_body(spec: SoakSpec, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.request.output_len, "stream": spec.is_stream,
                            "temperature": spec.temperature, "seed": spec.request.index,
                            "ignore_eos": spec.ignore_eos, "return_token_ids": True}
    if spec.is_stream:
        body["stream_options"] = {"include_usage": True}
    if spec.endpoint == "chat":
        words = [WORDS[t % len(WORDS)] for t in spec.request.prompt_token_ids]
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        body["prompt"] = list(spec.request.prompt_token_ids)
    return body


@dataclass
class SoakRecord(RequestRecord):
    """RequestRecord plus the soak's outcome; num_output_tokens counts the token ids the client received."""

    endpoint: str = ""
    is_stream: bool = True
    cancel: str = "none"
    phase: str = "soak"
    request_id: str = ""  # the gateway's id (the response's "id"); empty when none came back
    outcome: str = "pending"  # ok, cancelled, error, hung
    error_kind: str = ""  # http_<status>:<code>, stream_error:<code>, transport:<exception>, ...
    finish_reason: str | None = None
    usage_completion_tokens: int | None = None  # what the server's usage says
    ended_s: float | None = None  # seconds after the traffic started

    def to_json(self) -> str:
        """One line of requests.jsonl: every field but the per-token times, which a long soak would bloat."""
        data = asdict(self)
        del data["token_times_s"]
        if self.timings:
            data["timings"] = {k: v for k, v in self.timings.items() if k != "token_gaps_ms"}
        data["max_itl_s"] = max(self.itls_s, default=None)  # a stall (e.g. a migration) shows here
        data["tpot_s"] = self.tpot_s
        return json.dumps(data)


def _http_error(record: SoakRecord, status: int, body: bytes) -> None:
    record.outcome = "error"
    try:
        code = json.loads(body)["error"].get("code") or json.loads(body)["error"].get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        code = "?"
    record.error_kind = f"http_{status}:{code}"
    record.error = body.decode(errors="replace")[:300]


async def _stream(client: httpx.AsyncClient, path: str, spec: SoakSpec, body: dict[str, Any],
                  record: SoakRecord, sent: float) -> None:
    async with client.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            _http_error(record, response.status_code, await response.aread())
            return
        if spec.cancel == "before_first_token":  # headers came (admitted), no token yet: leave
            record.outcome = "cancelled"
            return
        saw_done = False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                saw_done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            record.request_id = record.request_id or chunk.get("id", "")
            if chunk.get("error"):
                record.outcome = "error"
                record.error_kind = f"stream_error:{chunk['error'].get('code')}"
                record.error = str(chunk["error"].get("message"))[:300]
                continue
            if chunk.get("usage"):
                record.usage_completion_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("timings"):
                record.timings = chunk["timings"]
            for choice in chunk.get("choices") or ():
                num_tokens = len(choice.get("token_ids") or ())
                if num_tokens:
                    record.token_times_s += [time.perf_counter() - sent] * num_tokens
                    record.num_output_tokens += num_tokens
                    record.ttft_s = record.token_times_s[0]
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if (spec.cancel == "after_tokens" and record.finish_reason is None
                    and record.num_output_tokens >= spec.cancel_after_tokens):
                record.outcome = "cancelled"
                return
        record.e2e_s = time.perf_counter() - sent
        if record.outcome != "error":
            if not saw_done:
                record.outcome, record.error_kind = "error", "truncated_stream"
            elif record.finish_reason is None:
                record.outcome, record.error_kind = "error", "no_finish_reason"
            else:
                record.outcome = "ok"


async def _whole(client: httpx.AsyncClient, path: str, spec: SoakSpec, body: dict[str, Any],
                 record: SoakRecord, sent: float) -> None:
    try:
        async with asyncio.timeout(spec.cancel_after_s if spec.cancel == "give_up" else None):
            response = await client.post(path, json=body)
    except TimeoutError:
        record.outcome = "cancelled"
        return
    record.status = response.status_code
    if response.status_code != 200:
        _http_error(record, response.status_code, response.content)
        return
    data = response.json()
    record.e2e_s = time.perf_counter() - sent
    record.request_id = data.get("id", "")
    choice = data["choices"][0]
    record.num_output_tokens = len(choice.get("token_ids") or ())
    record.finish_reason = choice.get("finish_reason")
    record.usage_completion_tokens = data.get("usage", {}).get("completion_tokens")
    record.timings = data.get("timings")
    record.outcome = "ok"


async def send(client: httpx.AsyncClient, spec: SoakSpec, model: str, start: float, hang_after_s: float,
               in_flight: list[int]) -> SoakRecord:
    await asyncio.sleep(max(0.0, start + spec.request.arrival_s - time.perf_counter()))
    sent = time.perf_counter()
    record = SoakRecord(spec.request.index, spec.request.arrival_s, sent - start,
                        len(spec.request.prompt_token_ids), spec.request.output_len, endpoint=spec.endpoint,
                        is_stream=spec.is_stream, cancel=spec.cancel, phase=spec.phase)
    path = "/v1/chat/completions" if spec.endpoint == "chat" else "/v1/completions"
    in_flight[0] += 1
    try:
        async with asyncio.timeout(hang_after_s):
            await (_stream if spec.is_stream else _whole)(client, path, spec, request_body(spec, model),
                                                           record, sent)
    except TimeoutError:
        record.outcome, record.error_kind = "hung", f"open after {hang_after_s:.0f} s"
    except httpx.HTTPError as error:
        record.outcome, record.error_kind = "error", f"transport:{type(error).__name__}"
        record.error = str(error)[:300]
    except ValueError as error:  # a chunk that is not JSON
        record.outcome, record.error_kind = "error", "bad_chunk"
        record.error = str(error)[:300]
    finally:
        in_flight[0] -= 1
        record.ended_s = time.perf_counter() - start
    return record
