"""What to send and when: request lengths (fixed, random, or from a trace) and arrival times.

Traces: the Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) and the Mooncake JSONL form
(`{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`), where equal hash ids mean equal
prompt blocks (shared prefixes). Arrivals: Poisson at a rate, gamma with a burstiness factor (1 = Poisson,
< 1 burstier), all at once (an infinite rate), or the trace's own timestamps divided by a speed factor.
Random fixed lengths may spread by a range ratio (vLLM's `--random-range-ratio`). ShareGPT prompts come
from loadgen/sharegpt.py.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

# Tokens per Mooncake hash id (the trace's block size), before length scaling.
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRow:
    timestamp_s: float  # seconds since the trace's first request
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one id per prompt block; equal ids mean equal blocks


@dataclass(frozen=True)
class RequestShape:
    """A request before its prompt exists: what a simulator needs, and what build_requests fills in."""

    index: int
    arrival_s: float  # seconds after the run starts
    input_len: int  # prompt tokens
    output_len: int  # max_tokens (the load generator sets ignore_eos, so also the tokens generated)
    hash_ids: tuple[int, ...] = ()  # Mooncake: the prompt's shared blocks


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float  # seconds after the run starts
    prompt_token_ids: tuple[int, ...]
    output_len: int
    prompt_text: str | None = None  # a text prompt (ShareGPT, chat): sent instead of the token ids


def read_trace(path: str | Path) -> list[TraceRow]:
    """Read an Azure CSV or Mooncake JSONL trace, by its content.

    Raises:
        ValueError: a row that is neither form, naming the line.
    """
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("{"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                rows.append(
                    TraceRow(
                        float(item["timestamp"]) / 1000.0,
                        int(item["input_length"]),
                        int(item["output_length"]),
                        tuple(item.get("hash_ids", ())),
                    )
                )
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row ({error})") from None
    else:
        rows = []
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None or not {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(
            reader.fieldnames
        ):
            raise ValueError(f"{path}: expected columns TIMESTAMP,ContextTokens,GeneratedTokens")
        first: datetime | None = None
        for number, item in enumerate(reader, 2):
            try:
                # Azure timestamps carry 7 fractional digits; datetime takes 6.
                stamp = datetime.fromisoformat(item["TIMESTAMP"][:26])
                first = first or stamp
                rows.append(
                    TraceRow(
                        (stamp - first).total_seconds(),
                        int(item["ContextTokens"]),
                        int(item["GeneratedTokens"]),
                    )
                )
            except ValueError as error:
                raise ValueError(f"{path}:{number}: bad row ({error})") from None
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    return rows


def poisson_arrivals(rate: float, count: int, rng: random.Random, burstiness: float = 1.0) -> list[float]:
    """Arrival times of `count` requests at `rate` per second; gamma gaps with shape `burstiness`
    (mean 1/rate; 1.0 is Poisson, smaller is burstier). An infinite rate sends them all at time 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * count
    times, now = [], 0.0
    for _ in range(count):
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    return times


def plan_requests(
    count: int,
    seed: int = 0,
    rate: float | None = None,
    burstiness: float = 1.0,
    trace: list[TraceRow] | None = None,
    speed: float = 1.0,
    input_len: int | None = None,
    output_len: int | None = None,
    length_scale: float = 1.0,
    duration_s: float | None = None,
    range_ratio: float = 0.0,
) -> list[RequestShape]:
    """The run's requests without their prompts: lengths from fixed values or the trace, arrivals from a
    rate or the trace. `build_requests` with the same arguments sends exactly these (the simulator of
    `pdserve tune` predicts from them).

    Args:
        rate: requests/s (Poisson or gamma); None replays the trace's timestamps divided by `speed`.
        input_len, output_len: fixed lengths; None takes them from the trace.
        length_scale: multiplies the trace's lengths (and Mooncake's block size), keeping their shape.
        duration_s: drop requests arriving after this.
        range_ratio: fixed lengths spread uniformly over [len·(1 - r), len·(1 + r)] (0: exactly len).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    # Its own stream: a range ratio of 0 leaves every earlier plan exactly as it was.
    length_rng = random.Random(f"lengths-{seed}")
    if trace is None and (input_len is None or output_len is None or rate is None):
        raise ValueError("without a trace, give a rate and both input and output lengths")
    rows = [trace[i % len(trace)] for i in range(count)] if trace else [TraceRow(0.0, 0, 0)] * count
    if rate is not None:
        arrivals = poisson_arrivals(rate, count, rng, burstiness)
    else:
        start = rows[0].timestamp_s
        arrivals = [(r.timestamp_s - start) / speed for r in rows]
    shapes = []
    for index, (row, arrival) in enumerate(zip(rows, arrivals, strict=True)):
        if duration_s is not None and arrival > duration_s:
            break
        n_in = input_len if input_len is not None else max(1, round(row.input_len * length_scale))
        n_out = output_len if output_len is not None else max(1, round(row.output_len * length_scale))
        if range_ratio > 0:
            low, high = 1 - range_ratio, 1 + range_ratio
            n_in, n_out = (max(1, length_rng.randint(math.floor(n * low), math.ceil(n * high)))
                           for n in (n_in, n_out))
        shapes.append(RequestShape(index, arrival, n_in, n_out, row.hash_ids))
    return shapes


def build_requests(
    count: int,
    vocab_size: int,
    seed: int = 0,
    rate: float | None = None,
    burstiness: float = 1.0,
    trace: list[TraceRow] | None = None,
    speed: float = 1.0,
    input_len: int | None = None,
    output_len: int | None = None,
    length_scale: float = 1.0,
    duration_s: float | None = None,
    prompt_seed: int | None = None,
    range_ratio: float = 0.0,
) -> list[RequestSpec]:
    """The requests of plan_requests (same arguments), with prompts: random token ids below `vocab_size`,
    and equal blocks wherever a Mooncake hash id recurs.

    Args:
        prompt_seed: draw the prompts' (unshared) tokens from this seed instead: the same lengths and
            arrivals with other prompts, so that runs replaying one plan do not hit each other's prefix
            cache (None: prompts continue the arrivals' stream, as they always have).
    """
    shapes = plan_requests(count, seed, rate, burstiness, trace, speed, input_len, output_len, length_scale,
                           duration_s, range_ratio)
    rng = random.Random(seed)
    if prompt_seed is not None:
        rng = random.Random(f"prompts-{prompt_seed}")
    elif rate is not None:
        poisson_arrivals(rate, count, rng, burstiness)
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale))
    requests = []
    for shape in shapes:
        prompt: list[int] = []
        for hash_id in shape.hash_ids:  # shared blocks: the same tokens wherever the id recurs
            block_rng = random.Random(hash_id * 7919 + seed)
            prompt += [block_rng.randrange(vocab_size) for _ in range(block_tokens)]
        n_in = shape.input_len
        prompt = prompt[:n_in] + [rng.randrange(vocab_size) for _ in range(max(0, n_in - len(prompt)))]
        requests.append(RequestSpec(shape.index, shape.arrival_s, tuple(prompt), shape.output_len))
    return requests
