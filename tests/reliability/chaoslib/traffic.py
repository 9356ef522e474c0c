"""(Over 300 lines: the base request kinds' senders and their checks, kept beside each other.)

What the chaos run sends, one client per request, and each request checked as it ends.

Kinds: "greedy" (token-id prompt from the reference pool, temperature 0, ignore_eos: compared token for
token), "sampled" (random token ids, temperature 0.8 with a seed), "chat" (words through the chat template);
and, a share of EXTRA_FRACTION of the arrivals, the kinds of chaoslib/extra_traffic.py (n_group,
best_of, tool_call, biased, echo_logprobs, max_tokens_0, batched), each checked in its own way there.
Client behaviours: "read" (reads to the end), "cancel_first" (leaves before the first token), "cancel_after"
(leaves after some tokens), "give_up" (a whole response abandoned after a delay), "stall_leave" and
"stall_resume" (a stream left unread for a few seconds, then closed, or read on to its end).

A request's outcome, set once it ends:
  ok         every token asked for (or a finish_reason "stop"), a finish_reason, [DONE] for a stream
  cancelled  the client left on purpose
  error      a clear error: HTTP 4xx/5xx with an OpenAI-shaped body, or an SSE error event
  cut        its connection failed, and it was a connection a frontend fault struck (kill or SIGSTOP of the
             frontend holding it: tests/reliability/chaoslib/frontends.py); only with several frontends
  violation  anything else: hung past its deadline, a stream cut without an error, a body that is not an
             OpenAI error, wrong tokens, too few tokens (the `violations` field says which)
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from tests.reliability.chaoslib.config import ChaosConfig
from tests.reliability.chaoslib.connections import PORTS
from tests.reliability.chaoslib.frontends import FrontendMap
from tests.reliability.chaoslib.reference import GreedyPrompt
from tests.reliability.soaklib.traffic import WORDS  # about one token each with SmolLM2's tokenizer

if TYPE_CHECKING:
    from tests.reliability.chaoslib.extra_traffic import ExtraRequest

CHAT_TEMPLATE_TOKENS = 40  # what the chat template adds around the words, at most (for the deadline)


@dataclass(frozen=True)
class ChaosSpec:
    index: int
    arrival_s: float
    kind: str  # "greedy", "sampled", "chat", or one of extra_traffic.EXTRA_KINDS
    is_stream: bool
    behaviour: str  # see the module docstring
    prompt_token_ids: tuple[int, ...]  # for chat: one word per id
    max_tokens: int
    reference: tuple[int, ...]  # greedy: the tokens it must get (the first max_tokens at most); else empty
    leave_after_tokens: int = 0  # cancel_after / stall_*: tokens read before leaving or stalling
    leave_after_s: float = 0.0  # give_up: seconds; stall_*: seconds left unread
    extra: ExtraRequest | None = None  # an extra kind's request (tests/reliability/chaoslib/extra_traffic.py)


@dataclass
class ChaosRecord:
    index: int
    kind: str
    is_stream: bool
    behaviour: str
    num_prompt_tokens: int
    max_tokens: int
    sent_s: float = 0.0  # after the run's start
    ended_s: float = 0.0
    status: int | None = None
    outcome: str = "pending"  # ok, cancelled, error, violation
    error_code: str = ""  # http_<status>:<code>, stream:<code>, transport:<exception>, hung
    error_message: str = ""
    num_tokens: int = 0  # token ids received
    finish_reason: str | None = None
    num_moves: int | None = None  # timings.num_moves: decode workers the stream left (failures and moves)
    client_port: int | None = None  # its connection's local port (several frontends: fresh connections)
    frontend_pid: int | None = None  # the frontend that held that connection, where a sample saw it
    cut_by: str = ""  # outcome "cut": the frontend fault that struck its connection
    violations: list[str] = field(default_factory=list)

    def violate(self, why: str) -> None:
        self.outcome = "violation"
        self.violations.append(why)


def build_specs(config: ChaosConfig, pool: list[GreedyPrompt], vocab_size: int,
                max_model_len: int) -> list[ChaosSpec]:
    from tests.reliability.chaoslib.extra_traffic import EXTRA_FRACTION, extra_spec  # it imports this module

    rng = random.Random(config.seed)
    specs: list[ChaosSpec] = []
    now = 0.0
    while True:
        now += rng.expovariate(config.rate)
        if now >= config.duration_s:
            return specs
        if rng.random() < EXTRA_FRACTION:
            specs.append(extra_spec(rng, len(specs), now, vocab_size))
            continue
        is_stream = rng.random() < 0.7
        draw = rng.random()
        if draw < config.greedy_fraction:
            kind, greedy = "greedy", rng.choice(pool)
            prompt, reference = greedy.prompt_token_ids, greedy.reference
            max_tokens = rng.randint(1, config.max_greedy_tokens)  # the reference may stop short (a tie)
            reference = reference[:max_tokens]
        else:
            kind = "chat" if draw < config.greedy_fraction + (1 - config.greedy_fraction) / 2 else "sampled"
            num_in = rng.randint(300, 700) if rng.random() < config.long_fraction else rng.randint(4, 64)
            max_tokens = rng.randint(1, 32) if rng.random() < 0.6 else rng.randint(64, 200)
            num_in = max(1, min(num_in, max_model_len - max_tokens - CHAT_TEMPLATE_TOKENS))
            prompt, reference = tuple(rng.randrange(vocab_size) for _ in range(num_in)), ()
        behaviour, after_tokens, after_s = "read", 0, 0.0
        draw = rng.random()
        if draw < config.cancel_fraction:
            if not is_stream:
                behaviour, after_s = "give_up", rng.uniform(0.0, 3.0)
            elif rng.random() < 0.3 or max_tokens < 2:
                behaviour = "cancel_first"
            else:
                behaviour, after_tokens = "cancel_after", rng.randint(1, max_tokens - 1)
        elif is_stream and max_tokens > 1 and draw < config.cancel_fraction + config.stall_fraction:
            behaviour = rng.choice(("stall_leave", "stall_resume"))
            after_tokens, after_s = rng.randint(1, max_tokens - 1), rng.uniform(1.0, 10.0)
        specs.append(ChaosSpec(len(specs), now, kind, is_stream, behaviour, prompt, max_tokens, reference,
                               after_tokens, after_s))


def request_body(spec: ChaosSpec, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": spec.is_stream,
                            "return_token_ids": True, "ignore_eos": spec.kind == "greedy",
                            "temperature": 0.0 if spec.kind == "greedy" else 0.8, "seed": spec.index}
    if spec.is_stream:
        body["stream_options"] = {"include_usage": True}
    if spec.kind == "chat":
        body["messages"] = [{"role": "user", "content": " ".join(WORDS[t % len(WORDS)]
                                                                 for t in spec.prompt_token_ids)}]
    else:
        body["prompt"] = list(spec.prompt_token_ids)
    return body


def error_answer(record: ChaosRecord, status: int, body: bytes) -> None:
    """An HTTP error: a clear one has OpenAI's shape, {"error": {"message": str, "type": str, ...}}."""
    record.outcome = "error"
    try:
        error = json.loads(body)["error"]
        if not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
            raise TypeError("no message or type")
        record.error_code = f"http_{status}:{error.get('code') or error['type']}"
        record.error_message = error["message"][:300]
    except (ValueError, KeyError, TypeError, AttributeError):
        record.error_code = f"http_{status}:?"
        record.violate(f"HTTP {status} without an OpenAI-shaped error: {body[:200]!r}")


def error_event(record: ChaosRecord, chunk: dict[str, Any]) -> None:
    """An SSE error event: a clear one has a message."""
    error = chunk["error"]
    record.outcome = "error"
    record.error_code = f"stream:{error.get('code') or error.get('type')}"
    record.error_message = str(error.get("message"))[:300]
    if not isinstance(error.get("message"), str):
        record.violate(f"an SSE error event without a message: {chunk}")


def _check_tokens(record: ChaosRecord, spec: ChaosSpec, tokens: list[int], is_whole: bool) -> None:
    """A greedy request's tokens must be the reference's (a prefix of them when cut short; as far as the
    reference goes, which stops before a near-tie); a whole answer must have every token asked for (or stop
    at EOS when ignore_eos is off)."""
    record.num_tokens = len(tokens)
    num_checked = min(len(tokens), len(spec.reference))
    if spec.kind == "greedy" and tuple(tokens[:num_checked]) != spec.reference[:num_checked]:
        pairs = zip(tokens, spec.reference, strict=False)
        first = next(i for i, (got, want) in enumerate(pairs) if got != want)
        record.violate(f"greedy tokens differ from transformers' at token {first} of {len(tokens)}")
    if is_whole and record.outcome == "ok":
        if record.finish_reason is None:
            record.violate("no finish_reason")
        elif len(tokens) < spec.max_tokens and (spec.kind == "greedy" or record.finish_reason == "length"):
            record.violate(f"{len(tokens)} of {spec.max_tokens} tokens, finish_reason "
                           f"{record.finish_reason!r}")
        elif len(tokens) > spec.max_tokens:
            record.violate(f"{len(tokens)} tokens for max_tokens {spec.max_tokens}")


async def _stream(client: httpx.AsyncClient, path: str, spec: ChaosSpec, body: dict[str, Any],
                  record: ChaosRecord) -> None:
    tokens: list[int] = []
    async with client.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            error_answer(record, response.status_code, await response.aread())
            return
        if spec.behaviour == "cancel_first":  # admitted (headers came), no token read: leave
            record.outcome = "cancelled"
            return
        saw_done, stalled = False, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                saw_done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                error_event(record, chunk)
                continue
            if chunk.get("timings"):
                record.num_moves = chunk["timings"].get("num_moves")
            for choice in chunk.get("choices") or ():
                tokens += choice.get("token_ids") or ()
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if record.finish_reason is None and len(tokens) >= spec.leave_after_tokens > 0:
                if spec.behaviour == "cancel_after" or spec.behaviour == "stall_leave":
                    if spec.behaviour == "stall_leave":
                        await asyncio.sleep(spec.leave_after_s)  # connection open, nothing read
                    record.outcome = "cancelled"
                    _check_tokens(record, spec, tokens, is_whole=False)
                    return
                if spec.behaviour == "stall_resume" and not stalled:
                    stalled = True
                    await asyncio.sleep(spec.leave_after_s)  # then read on to the end
    if record.outcome in ("error", "violation"):
        _check_tokens(record, spec, tokens, is_whole=False)
        return
    record.outcome = "ok"
    if not saw_done:
        record.violate(f"the stream ended without [DONE] or an error event after {len(tokens)} tokens")
    _check_tokens(record, spec, tokens, is_whole=True)


async def post_whole(client: httpx.AsyncClient, path: str, spec: ChaosSpec, body: dict[str, Any],
                     record: ChaosRecord) -> dict[str, Any] | None:
    """POST for a whole answer: its JSON on 200; else None, the record's outcome set (cancelled by a client
    that gives up, or the error answer checked)."""
    try:
        async with asyncio.timeout(spec.leave_after_s if spec.behaviour == "give_up" else None):
            response = await client.post(path, json=body)
    except TimeoutError:
        record.outcome = "cancelled"
        return None
    record.status = response.status_code
    if response.status_code != 200:
        error_answer(record, response.status_code, response.content)
        return None
    return dict(response.json())


async def _whole(client: httpx.AsyncClient, path: str, spec: ChaosSpec, body: dict[str, Any],
                 record: ChaosRecord) -> None:
    data = await post_whole(client, path, spec, body, record)
    if data is None:
        return
    choice = data["choices"][0]
    record.finish_reason = choice.get("finish_reason")
    record.num_moves = (data.get("timings") or {}).get("num_moves")
    record.outcome = "ok"
    _check_tokens(record, spec, list(choice.get("token_ids") or ()), is_whole=True)


def connection_failed(record: ChaosRecord, error: httpx.HTTPError, frontends: FrontendMap | None,
                      now_s: float) -> None:
    """A transport error: "cut" when a frontend fault struck this request's connection, else a violation."""
    record.error_code = f"transport:{type(error).__name__}"
    record.error_message = str(error)[:300]
    cut = frontends.cut_of(record.client_port, record.sent_s, now_s) if frontends is not None else None
    if cut is not None:
        record.outcome = "cut"
        record.cut_by = cut.name
    else:
        record.violate(f"the connection failed without an error: {type(error).__name__}: {error}")


async def send(client: httpx.AsyncClient, spec: ChaosSpec, model: str, start: float,
               config: ChaosConfig, in_flight: list[int], frontends: FrontendMap | None = None
               ) -> ChaosRecord:
    """Send one request at its arrival time; it must end by its server deadline plus the hang grace."""
    await asyncio.sleep(max(0.0, start + spec.arrival_s - time.perf_counter()))
    from tests.reliability.chaoslib import extra_traffic  # it imports this module

    ports: list[int] = []
    PORTS.set(ports)  # this task's: its connection's port lands here
    num_in = len(spec.prompt_token_ids) + (CHAT_TEMPLATE_TOKENS if spec.kind == "chat" else 0)
    if spec.extra is not None:
        num_in = extra_traffic.num_prompt_tokens(spec)
    record = ChaosRecord(spec.index, spec.kind, spec.is_stream, spec.behaviour, num_in, spec.max_tokens,
                         sent_s=time.perf_counter() - start)
    path = "/v1/chat/completions" if spec.kind == "chat" else "/v1/completions"
    bound_s = config.deadline_s(num_in, spec.max_tokens) + (
        spec.leave_after_s if spec.behaviour == "stall_resume" else 0.0)
    in_flight[0] += 1
    try:
        async with asyncio.timeout(bound_s):
            if spec.extra is not None:
                await extra_traffic.run_extra(client, spec, extra_traffic.extra_body(spec, model), record)
            else:
                body = request_body(spec, model)
                await (_stream if spec.is_stream else _whole)(client, path, spec, body, record)
    except TimeoutError:
        record.error_code = "hung"
        record.violate(f"still open {bound_s:.0f} s after it was sent (deadline + {config.hang_grace_s:g} s)")
    except httpx.HTTPError as error:
        record.client_port = ports[-1] if ports else None
        connection_failed(record, error, frontends, time.perf_counter() - start)
    except (ValueError, KeyError, IndexError) as error:  # a chunk or body that is not what OpenAI sends
        record.violate(f"a malformed response: {type(error).__name__}: {error}")
    finally:
        in_flight[0] -= 1
        record.ended_s = time.perf_counter() - start
        record.client_port = ports[-1] if ports else None
    return record


def record_row(record: ChaosRecord) -> str:
    return json.dumps(asdict(record))
