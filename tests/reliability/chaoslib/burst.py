"""loop_burst: loop-heavy requests all at once, on fresh connections (so on every frontend): the review's N1
(a frontend whose event loop is busy must not be taken for dead, nor cost a worker).

A burst is NUM_SCHEMAS chat completions, each with its own large `response_format` json_schema
(PROPERTIES_PER_SCHEMA properties, names never seen before: nothing is cached), and NUM_TOKENIZE /tokenize
calls of TOKENIZE_CHARS characters of text (the server's cap is 1 MiB). Each is a ChaosRecord (kind
"schema" or "tokenize", behaviour "burst") checked as the traffic's are: 200 with a body of the right shape,
or a clear (OpenAI-shaped) error, within its deadline; a connection error only where a frontend fault
struck that connection. The driver does not wait for a burst: finish() collects its records.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.chaoslib.config import ChaosConfig
from tests.reliability.chaoslib.connections import PORTS
from tests.reliability.chaoslib.frontends import FrontendMap
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.traffic import ChaosRecord, connection_failed, error_answer
from tests.reliability.soaklib.traffic import WORDS

NUM_SCHEMAS = 80  # the review's burst: more than the worker's 64 cached grammars
PROPERTIES_PER_SCHEMA = 200
NUM_TOKENIZE = 4
TOKENIZE_CHARS = 900_000
SCHEMA_MAX_TOKENS = 8  # the grammar is the cost, not the output
FIRST_INDEX = 1_000_000  # burst records' indices, apart from the traffic's


def form_schema(rng: random.Random, nonce: str) -> dict[str, Any]:
    """An object of PROPERTIES_PER_SCHEMA required properties of mixed types, every name new."""
    properties: dict[str, Any] = {}
    for i in range(PROPERTIES_PER_SCHEMA):
        name = f"{rng.choice(WORDS)}_{nonce}_{i}"
        kind = i % 5
        if kind == 0:
            properties[name] = {"type": "integer", "minimum": 0, "maximum": rng.randint(10, 10_000)}
        elif kind == 1:
            properties[name] = {"type": "string", "maxLength": rng.randint(4, 40)}
        elif kind == 2:
            properties[name] = {"type": "boolean"}
        elif kind == 3:
            properties[name] = {"enum": rng.sample(WORDS, 3)}
        else:
            properties[name] = {"type": "number"}
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


@dataclass
class LoopBurst:
    config: ChaosConfig
    client: httpx.AsyncClient
    log: ChaosLog
    frontends: FrontendMap | None
    model: str
    rng: random.Random
    _tasks: list[asyncio.Task[ChaosRecord]] = field(default_factory=list)

    def start(self) -> str:
        """Send one burst (not awaited)."""
        burst = len(self._tasks) // (NUM_SCHEMAS + NUM_TOKENIZE)
        for k in range(NUM_SCHEMAS):
            schema = form_schema(self.rng, f"b{burst}s{k}")
            response_format = {"type": "json_schema",
                               "json_schema": {"name": f"form_{k}", "schema": schema, "strict": True}}
            body = {"model": self.model, "max_tokens": SCHEMA_MAX_TOKENS, "temperature": 0.0,
                    "messages": [{"role": "user", "content": "Fill in the form."}],
                    "response_format": response_format}
            self._send("schema", "/v1/chat/completions", body)
        for _ in range(NUM_TOKENIZE):
            text = " ".join(self.rng.choices(WORDS, k=TOKENIZE_CHARS // 4))[:TOKENIZE_CHARS]
            self._send("tokenize", "/tokenize", {"model": self.model, "prompt": text})
        self.log.event("loop_burst", burst=burst, num_schemas=NUM_SCHEMAS,
                       properties_per_schema=PROPERTIES_PER_SCHEMA, num_tokenize=NUM_TOKENIZE,
                       tokenize_chars=TOKENIZE_CHARS, start_s=round(self.log.now(), 3))
        return "sent"

    def _send(self, kind: str, path: str, body: dict[str, Any]) -> None:
        index = FIRST_INDEX + len(self._tasks)
        max_tokens = SCHEMA_MAX_TOKENS if kind == "schema" else 0
        record = ChaosRecord(index, kind, False, "burst", 0, max_tokens, sent_s=self.log.now())
        self._tasks.append(asyncio.create_task(self._one(record, path, body)))

    async def _one(self, record: ChaosRecord, path: str, body: dict[str, Any]) -> ChaosRecord:
        ports: list[int] = []
        PORTS.set(ports)
        bound_s = self.config.deadline_s(0, record.max_tokens)
        try:
            async with asyncio.timeout(bound_s):
                response = await self.client.post(path, json=body)
            record.status = response.status_code
            if response.status_code != 200:
                error_answer(record, response.status_code, response.content)
            else:
                _check_answer(record, response.json())
        except TimeoutError:
            record.error_code = "hung"
            record.violate(f"still open {bound_s:.0f} s after it was sent")
        except httpx.HTTPError as error:
            record.client_port = ports[-1] if ports else None
            connection_failed(record, error, self.frontends, self.log.now())
        except (ValueError, KeyError, IndexError, TypeError) as error:
            record.violate(f"a malformed response: {type(error).__name__}: {error}")
        finally:
            record.ended_s = self.log.now()
            record.client_port = ports[-1] if ports else None
        return record

    async def records(self) -> list[ChaosRecord]:
        return list(await asyncio.gather(*self._tasks))


def _check_answer(record: ChaosRecord, data: dict[str, Any]) -> None:
    record.outcome = "ok"
    if record.kind == "tokenize":
        if not isinstance(data["tokens"], list) or data["count"] != len(data["tokens"]) or not data["count"]:
            record.violate(f"/tokenize answered count {data.get('count')} for {TOKENIZE_CHARS} characters")
        return
    choice = data["choices"][0]
    record.finish_reason = choice.get("finish_reason")
    if record.finish_reason not in ("length", "stop"):
        record.violate(f"finish_reason {record.finish_reason!r}")
    record.num_tokens = int(data.get("usage", {}).get("completion_tokens", 0))

