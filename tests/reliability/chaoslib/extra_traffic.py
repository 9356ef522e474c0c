"""(Over 300 lines: one sender and one checker per request kind, kept beside each other.)

The request kinds the base mix never sent (issue 31, item 2): a share of EXTRA_FRACTION of the arrivals,
drawn with the run's seeded rng (tests/reliability/chaoslib/traffic.py build_specs), each checked as it ends.

Kinds (ChaosRecord.kind):
  n_group        n = 2..3 choices, completions or chat, streamed or not; some clients leave mid-group
                 ("cancel_after": a stream left after some tokens of the group; "give_up": a whole response
                 abandoned after a delay)
  best_of        completions, best_of 2..3 with n 1 (or 2 of 3), whole (a stream refuses best_of > n); some
                 given up mid-group
  tool_call      chat with `tools` (one small function, sometimes a decoy beside it) and `tool_choice` naming
                 it, streamed or not
  biased         logit_bias (a few token ids → -100 or +5) and presence / frequency penalties, seeded sampling
  echo_logprobs  completions of a token-id prompt with echo and logprobs 1..3, streamed or not
  max_tokens_0   completions with max_tokens 0, echo and logprobs 0..2: the prompt scored, nothing generated
  batched        completions of a batch of 2..3 prompts (token-id lists or texts), n 1..2, whole (a stream of
                 a batch is refused)

Checks of an answer that ends "ok" (else a violation naming what was wrong):
  - every choice index 0..N-1 and no other (N = n, or prompts × n), each with a finish_reason of "stop",
    "length" (then exactly max_tokens tokens) or, for tool_call, "tool_calls"; no choice with more than
    max_tokens tokens, none with a chunk after its finish_reason; a stream ends with [DONE];
  - usage (whole, or a stream's include_usage chunk): completion_tokens the sum of the choices' tokens (at
    least that for best_of, which counts every choice generated), prompt_tokens the token-id prompts' lengths;
  - tool_call: a choice not cut by length finishes "tool_calls" with tool_calls[0] naming the function and
    arguments that parse as a JSON object with the schema's required keys (and their types);
  - biased: no generated token is one biased by -100;
  - echo_logprobs, max_tokens_0: the logprobs cover the prompt and the completion, one entry per token
    (tokens, token_logprobs, text_offset; top_logprobs when logprobs > 0): the first token's logprob null,
    the others ≤ 0; max_tokens_0: no token generated, finish_reason "length", completion_tokens 0.
A client that left, or an answer that is a clear error, is checked as far as it went (indices, token counts).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.chaoslib.traffic import (
    CHAT_TEMPLATE_TOKENS,
    ChaosRecord,
    ChaosSpec,
    error_answer,
    error_event,
    post_whole,
)
from tests.reliability.soaklib.traffic import WORDS

EXTRA_FRACTION = 0.2  # of the arrivals, whatever the config
EXTRA_KINDS = ("n_group", "best_of", "tool_call", "biased", "echo_logprobs", "max_tokens_0", "batched")
GROUP_CANCEL_FRACTION = 0.3  # n_group, best_of, batched: clients that leave mid-group
TOOL_PROMPT_TOKENS = 400  # the tools described in the system message, at most (for the deadline)
CITIES = ("paris", "oslo", "lima", "cairo", "quito")
TOOLS: dict[str, dict[str, Any]] = {  # name → its parameters' schema (small: the compile is not the point)
    "get_weather": {"type": "object", "properties": {
        "city": {"type": "string", "enum": list(CITIES)},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False},
    "book_table": {"type": "object", "properties": {
        "city": {"type": "string", "enum": list(CITIES)},
        "people": {"type": "integer", "minimum": 1, "maximum": 12},
        "outdoor": {"type": "boolean"}},
        "required": ["city", "people", "outdoor"], "additionalProperties": False},
    "convert_units": {"type": "object", "properties": {
        "value": {"type": "number"}, "unit": {"type": "string", "enum": ["km", "mi", "kg", "lb"]}},
        "required": ["value", "unit"], "additionalProperties": False},
}
JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                           "boolean": (bool,)}


@dataclass(frozen=True)
class ExtraRequest:
    """What an extra kind's request asks beyond ChaosSpec's fields."""

    is_chat: bool = False
    n: int = 1
    best_of: int | None = None
    prompts: tuple[tuple[int, ...], ...] = ()  # batched: token-id prompts
    text_prompts: tuple[str, ...] = ()  # batched: text prompts instead
    echo: bool = False
    logprobs: int | None = None  # completions' logprobs (alternatives per token)
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tool_name: str = ""  # tool_call: the function tool_choice names
    decoy_tool: str = ""  # tool_call: another function offered beside it ("" none)

    @property
    def num_prompts(self) -> int:
        return len(self.prompts) or len(self.text_prompts) or 1

    @property
    def num_choices(self) -> int:
        """Choices the answer carries: n per prompt (best_of's extra ones are not returned)."""
        return self.num_prompts * self.n


def _ids(rng: random.Random, vocab_size: int, num: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(num))


def _leave(rng: random.Random, spec_stream: bool, num_tokens: int) -> tuple[str, int, float]:
    """A mid-group departure (behaviour, tokens read first, seconds waited first), or a reader."""
    if rng.random() >= GROUP_CANCEL_FRACTION:
        return "read", 0, 0.0
    if spec_stream:
        return "cancel_after", rng.randint(1, max(1, num_tokens - 1)), 0.0
    return "give_up", 0, rng.uniform(0.0, 3.0)


def extra_spec(rng: random.Random, index: int, arrival_s: float, vocab_size: int) -> ChaosSpec:
    """One request of an extra kind, drawn with the run's rng."""
    kind = rng.choice(EXTRA_KINDS)
    prompt = _ids(rng, vocab_size, rng.randint(4, 64))
    is_stream = rng.random() < 0.5
    max_tokens = rng.randint(1, 48)
    behaviour, after_tokens, after_s = "read", 0, 0.0
    if kind == "n_group":
        extra = ExtraRequest(is_chat=rng.random() < 0.5, n=rng.randint(2, 3))
        behaviour, after_tokens, after_s = _leave(rng, is_stream, extra.n * max_tokens)
    elif kind == "best_of":
        best_of = rng.randint(2, 3)
        extra = ExtraRequest(n=1 if best_of == 2 or rng.random() < 0.5 else 2, best_of=best_of)
        is_stream = False
        behaviour, after_tokens, after_s = _leave(rng, is_stream, 0)
    elif kind == "tool_call":
        name = rng.choice(sorted(TOOLS))
        decoy = rng.choice([t for t in sorted(TOOLS) if t != name]) if rng.random() < 0.5 else ""
        extra = ExtraRequest(is_chat=True, tool_name=name, decoy_tool=decoy)
        max_tokens = rng.randint(64, 128)
    elif kind == "biased":
        ids = rng.sample(range(vocab_size), rng.randint(2, 6))  # the first banned, the others either
        bias = tuple((t, -100.0 if i == 0 or rng.random() < 0.5 else 5.0) for i, t in enumerate(ids))
        extra = ExtraRequest(is_chat=rng.random() < 0.3, logit_bias=bias,
                             presence_penalty=round(rng.uniform(-1.0, 2.0), 2),
                             frequency_penalty=round(rng.uniform(-1.0, 2.0), 2))
    elif kind == "echo_logprobs":
        extra = ExtraRequest(echo=True, logprobs=rng.randint(1, 3))
        max_tokens = rng.randint(1, 16)
    elif kind == "max_tokens_0":
        extra = ExtraRequest(echo=True, logprobs=rng.randint(0, 2))
        max_tokens = 0
    else:  # batched
        num, n = rng.randint(2, 3), 1 if rng.random() < 0.7 else 2
        if rng.random() < 0.5:
            extra = ExtraRequest(n=n, prompts=tuple(_ids(rng, vocab_size, rng.randint(4, 48))
                                                    for _ in range(num)))
        else:
            extra = ExtraRequest(n=n, text_prompts=tuple(" ".join(rng.choices(WORDS, k=rng.randint(4, 48)))
                                                         for _ in range(num)))
        prompt = tuple(t for p in extra.prompts for t in p)
        is_stream = False
        behaviour, after_tokens, after_s = _leave(rng, is_stream, 0)
    return ChaosSpec(index, arrival_s, kind, is_stream, behaviour, prompt, max_tokens, (), after_tokens,
                     after_s, extra=extra)


def _extra(spec: ChaosSpec) -> ExtraRequest:
    assert spec.extra is not None, f"request {spec.index} ({spec.kind}) is not of an extra kind"
    return spec.extra


def num_prompt_tokens(spec: ChaosSpec) -> int:
    """The prompt's tokens, about (for the deadline and the record)."""
    extra = _extra(spec)
    if extra.text_prompts:
        return sum(len(p.split()) for p in extra.text_prompts)  # about one token a word
    if not extra.is_chat:
        return len(spec.prompt_token_ids)
    return len(spec.prompt_token_ids) + CHAT_TEMPLATE_TOKENS + (TOOL_PROMPT_TOKENS if extra.tool_name else 0)


def path_of(spec: ChaosSpec) -> str:
    return "/v1/chat/completions" if _extra(spec).is_chat else "/v1/completions"


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}.",
                                             "parameters": TOOLS[name]}}


def extra_body(spec: ChaosSpec, model: str) -> dict[str, Any]:
    extra = _extra(spec)
    body: dict[str, Any] = {"model": model, "max_tokens": spec.max_tokens, "stream": spec.is_stream,
                            "return_token_ids": True, "temperature": 0.8, "seed": spec.index}
    if spec.is_stream:
        body["stream_options"] = {"include_usage": True}
    if extra.n > 1:
        body["n"] = extra.n
    if extra.best_of is not None:
        body["best_of"] = extra.best_of
    if extra.echo:
        body["echo"] = True
    if extra.logprobs is not None:
        body["logprobs"] = extra.logprobs
    if extra.logit_bias:
        body["logit_bias"] = {str(t): bias for t, bias in extra.logit_bias}
    if extra.presence_penalty or extra.frequency_penalty:
        body["presence_penalty"] = extra.presence_penalty
        body["frequency_penalty"] = extra.frequency_penalty
    if extra.is_chat:
        words = " ".join(WORDS[t % len(WORDS)] for t in spec.prompt_token_ids)
        body["messages"] = [{"role": "user", "content": words}]
        if extra.tool_name:
            offered = [extra.tool_name, extra.decoy_tool] if extra.decoy_tool else [extra.tool_name]
            body["tools"] = [tool(name) for name in sorted(offered)]
            body["tool_choice"] = {"type": "function", "function": {"name": extra.tool_name}}
    elif extra.prompts:
        body["prompt"] = [list(p) for p in extra.prompts]
    elif extra.text_prompts:
        body["prompt"] = list(extra.text_prompts)
    else:
        body["prompt"] = list(spec.prompt_token_ids)
    return body


@dataclass
class ChoiceSeen:
    """One choice as the client got it (a whole one, or a stream's chunks joined)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text: str = ""
    has_logprobs: bool = False
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None  # None: none came
    text_offset: list[int] = field(default_factory=list)
    calls: dict[int, dict[str, str]] = field(default_factory=dict)  # call index → name, arguments
    late: bool = False  # a chunk came after its finish_reason


@dataclass
class Answer:
    choices: dict[int, ChoiceSeen] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    saw_done: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices.values())

    def add(self, choice: dict[str, Any], is_whole: bool) -> None:
        """A whole choice, or a stream chunk's piece of one."""
        index = choice["index"]
        seen = self.choices.setdefault(index, ChoiceSeen())
        seen.late = seen.late or seen.finish_reason is not None
        seen.token_ids += choice.get("token_ids") or ()
        message = choice.get("message" if is_whole else "delta")
        if message is not None:  # chat
            seen.text += message.get("content") or ""
            for k, piece in enumerate(message.get("tool_calls") or ()):
                call = seen.calls.setdefault(piece.get("index", k), {"name": "", "arguments": ""})
                function = piece.get("function") or {}
                call["name"] = function.get("name") or call["name"]
                call["arguments"] += function.get("arguments") or ""
        else:
            seen.text += choice.get("text") or ""
        logprobs = choice.get("logprobs")
        if logprobs is not None and "tokens" in logprobs:  # completions' lists
            seen.has_logprobs = True
            seen.tokens += logprobs["tokens"]
            seen.token_logprobs += logprobs["token_logprobs"]
            seen.text_offset += logprobs["text_offset"]
            if logprobs.get("top_logprobs") is not None:
                seen.top_logprobs = (seen.top_logprobs or []) + logprobs["top_logprobs"]
        seen.finish_reason = choice.get("finish_reason") or seen.finish_reason


async def run_extra(client: httpx.AsyncClient, spec: ChaosSpec, body: dict[str, Any],
                    record: ChaosRecord) -> None:
    """Send an extra kind's request and check its answer (traffic.send bounds it by its deadline)."""
    try:
        await (_stream if spec.is_stream else _whole)(client, path_of(spec), spec, body, record)
    except (TypeError, AttributeError) as error:  # a body of another shape than OpenAI's
        record.violate(f"a malformed response: {type(error).__name__}: {error}")


async def _stream(client: httpx.AsyncClient, path: str, spec: ChaosSpec, body: dict[str, Any],
                  record: ChaosRecord) -> None:
    answer = Answer()
    num_choices = _extra(spec).num_choices
    async with client.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            error_answer(record, response.status_code, await response.aread())
            return
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                answer.saw_done = True
                break
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                error_event(record, chunk)
                continue
            if chunk.get("timings"):
                record.num_moves = chunk["timings"].get("num_moves")
            answer.usage = chunk.get("usage") or answer.usage
            for choice in chunk.get("choices") or ():
                answer.add(choice, is_whole=False)
            finished = sum(c.finish_reason is not None for c in answer.choices.values())
            if (spec.behaviour == "cancel_after" and answer.num_tokens >= spec.leave_after_tokens
                    and finished < num_choices):
                record.outcome = "cancelled"
                check_partial(record, spec, answer)
                return
    if record.outcome in ("error", "violation"):
        check_partial(record, spec, answer)
        return
    record.outcome = "ok"
    if not answer.saw_done:
        record.violate(f"the stream ended without [DONE] or an error event after {answer.num_tokens} tokens")
    check_answer(record, spec, answer)


async def _whole(client: httpx.AsyncClient, path: str, spec: ChaosSpec, body: dict[str, Any],
                 record: ChaosRecord) -> None:
    data = await post_whole(client, path, spec, body, record)
    if data is None:
        return
    answer = Answer(usage=data.get("usage"), saw_done=True)
    for choice in data["choices"]:
        answer.add(choice, is_whole=True)
    record.num_moves = (data.get("timings") or {}).get("num_moves")
    record.outcome = "ok"
    check_answer(record, spec, answer)


def _note(record: ChaosRecord, answer: Answer) -> None:
    record.num_tokens = answer.num_tokens
    record.finish_reason = ",".join(str(answer.choices[i].finish_reason) for i in sorted(answer.choices)
                                    ) or None


def check_partial(record: ChaosRecord, spec: ChaosSpec, answer: Answer) -> None:
    """What a client that left (or got an error) saw: only choices it asked for, none past max_tokens."""
    _note(record, answer)
    num_choices = _extra(spec).num_choices
    for index, seen in sorted(answer.choices.items()):
        if not 0 <= index < num_choices:
            record.violate(f"a choice of index {index} (asked for {num_choices})")
        if len(seen.token_ids) > spec.max_tokens:
            record.violate(f"choice {index}: {len(seen.token_ids)} tokens for max_tokens {spec.max_tokens}")
        if seen.late:
            record.violate(f"choice {index}: a chunk after its finish_reason")
    if spec.kind == "biased":
        _check_bias(record, spec, answer)


def check_answer(record: ChaosRecord, spec: ChaosSpec, answer: Answer) -> None:
    """A whole answer (or a stream read to its end) of an extra kind: see the module docstring."""
    extra = _extra(spec)
    check_partial(record, spec, answer)
    missing = sorted(set(range(extra.num_choices)) - set(answer.choices))
    if missing:
        record.violate(f"choices {missing} missing (of {extra.num_choices}; got {sorted(answer.choices)})")
    reasons = ("stop", "length", "tool_calls") if spec.kind == "tool_call" else ("stop", "length")
    for index, seen in sorted(answer.choices.items()):
        if seen.finish_reason not in reasons:
            record.violate(f"choice {index}: finish_reason {seen.finish_reason!r}")
        elif seen.finish_reason == "length" and len(seen.token_ids) != spec.max_tokens:
            record.violate(f"choice {index}: finish_reason 'length' after {len(seen.token_ids)} of "
                           f"{spec.max_tokens} tokens")
    _check_usage(record, spec, answer)
    if spec.kind == "tool_call":
        _check_tool_calls(record, extra, answer)
    elif extra.echo:
        for index, seen in sorted(answer.choices.items()):
            _check_echo_logprobs(record, spec, index, seen)


def _check_usage(record: ChaosRecord, spec: ChaosSpec, answer: Answer) -> None:
    extra = _extra(spec)
    usage = answer.usage
    if usage is None:
        record.violate("no usage (whole, or a stream with include_usage)")
        return
    completion, total = usage.get("completion_tokens"), answer.num_tokens
    if extra.best_of is not None and extra.best_of > extra.n:
        if not isinstance(completion, int) or completion < total:
            record.violate(f"usage.completion_tokens {completion} < the {total} tokens of the choices "
                           f"returned (best_of {extra.best_of} counts every choice generated)")
    elif completion != total:
        record.violate(f"usage.completion_tokens {completion}, the choices have {total} tokens")
    if not extra.is_chat and not extra.text_prompts:
        prompts = extra.prompts or (spec.prompt_token_ids,)
        want = sum(len(p) for p in prompts)
        if usage.get("prompt_tokens") != want:
            record.violate(f"usage.prompt_tokens {usage.get('prompt_tokens')}, the prompts have {want}")


def _check_bias(record: ChaosRecord, spec: ChaosSpec, answer: Answer) -> None:
    banned = {t for t, bias in _extra(spec).logit_bias if bias <= -100.0}
    for index, seen in sorted(answer.choices.items()):
        hits = sorted(banned & set(seen.token_ids))
        if hits:
            record.violate(f"choice {index}: generated token(s) {hits}, biased by -100")


def _check_tool_calls(record: ChaosRecord, extra: ExtraRequest, answer: Answer) -> None:
    schema = TOOLS[extra.tool_name]
    for index, seen in sorted(answer.choices.items()):
        if seen.finish_reason == "length":
            continue  # cut before the call closed: nothing to hold it to
        if seen.finish_reason != "tool_calls":
            record.violate(f"choice {index}: a forced call ended {seen.finish_reason!r}, not 'tool_calls' "
                           f"(text {seen.text[:120]!r})")
            continue
        if not seen.calls or min(seen.calls) != 0:
            record.violate(f"choice {index}: finish_reason 'tool_calls' without tool_calls[0]")
            continue
        call = seen.calls[0]
        if call["name"] != extra.tool_name:
            record.violate(f"choice {index}: tool_calls[0] calls {call['name']!r}, tool_choice named "
                           f"{extra.tool_name!r}")
        try:
            arguments = json.loads(call["arguments"])
        except ValueError:
            record.violate(f"choice {index}: tool_calls[0] arguments are not JSON: "
                           f"{call['arguments'][:200]!r}")
            continue
        if not isinstance(arguments, dict):
            record.violate(f"choice {index}: tool_calls[0] arguments are not an object: {arguments!r:.200}")
            continue
        for key in schema["required"]:
            if key not in arguments:
                record.violate(f"choice {index}: tool_calls[0] arguments lack {key!r}: {arguments!r:.200}")
        for key, value in arguments.items():
            prop = schema["properties"].get(key)
            if prop is None:
                record.violate(f"choice {index}: tool_calls[0] argument {key!r} not in the schema")
            elif "enum" in prop and value not in prop["enum"]:
                record.violate(f"choice {index}: tool_calls[0] argument {key}={value!r} not in "
                               f"{prop['enum']}")
            elif not isinstance(value, JSON_TYPES[prop["type"]]) or (
                    prop["type"] != "boolean" and isinstance(value, bool)):
                record.violate(f"choice {index}: tool_calls[0] argument {key}={value!r} not a {prop['type']}")


def _check_echo_logprobs(record: ChaosRecord, spec: ChaosSpec, index: int, seen: ChoiceSeen) -> None:
    """echo with logprobs: one entry per prompt token, then per generated token."""
    k = _extra(spec).logprobs
    if spec.kind == "max_tokens_0" and (seen.token_ids or seen.finish_reason != "length"):
        record.violate(f"choice {index}: max_tokens 0 generated {len(seen.token_ids)} tokens, finish_reason "
                       f"{seen.finish_reason!r}")
    if k is None:
        return
    if not seen.has_logprobs:
        record.violate(f"choice {index}: echo with logprobs {k} answered no logprobs")
        return
    want = len(spec.prompt_token_ids) + len(seen.token_ids)
    lengths = {"tokens": len(seen.tokens), "token_logprobs": len(seen.token_logprobs),
               "text_offset": len(seen.text_offset)}
    if k > 0:
        lengths["top_logprobs"] = len(seen.top_logprobs or ())
    elif seen.top_logprobs is not None:
        record.violate(f"choice {index}: top_logprobs with logprobs 0")
    wrong = {name: n for name, n in lengths.items() if n != want}
    if wrong:
        record.violate(f"choice {index}: logprobs cover {wrong} tokens, the prompt and completion have "
                       f"{want} ({len(spec.prompt_token_ids)} + {len(seen.token_ids)})")
        return
    first, *rest = seen.token_logprobs
    if first is not None:
        record.violate(f"choice {index}: the prompt's first token has logprob {first} (no context: null)")
    bad = [(i, lp) for i, lp in enumerate(rest, start=1)
           if not isinstance(lp, int | float) or math.isnan(lp) or lp > 1e-4]
    if bad:
        record.violate(f"choice {index}: token_logprobs not a logprob ≤ 0 at {bad[:3]}")
    if seen.text_offset and (seen.text_offset[0] != 0 or any(
            b < a for a, b in zip(seen.text_offset, seen.text_offset[1:], strict=False))):
        record.violate(f"choice {index}: text_offset not rising from 0: {seen.text_offset[:8]}")
    if k > 0 and seen.top_logprobs is not None:
        bad_top = [i for i, top in enumerate(seen.top_logprobs) if (
            top is not None if i == 0 else not isinstance(top, dict) or not 1 <= len(top) <= k + 1)]
        if bad_top:
            record.violate(f"choice {index}: top_logprobs (of {k}) wrong at {bad_top[:5]}: "
                           f"{[seen.top_logprobs[i] for i in bad_top[:2]]}")
