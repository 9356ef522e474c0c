"""Samples the server's /metrics while a run lasts: queue depth in tokens per pool, KV occupancy, running."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    t_s: float  # seconds since the run started
    queued_prompt_tokens: dict[str, float]  # per pool
    kv_occupancy: dict[str, float]  # per worker
    running_requests: dict[str, float]  # per worker


def parse_sample(text: str, t_s: float) -> Sample:
    queued: dict[str, float] = {}
    occupancy: dict[str, float] = {}
    running: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "pdserve:queued_prompt_tokens":
                queued[s.labels["pool"]] = s.value
            elif s.name == "pdserve:kv_cache_usage_perc":
                occupancy[s.labels["worker"]] = s.value
            elif s.name == "pdserve:num_requests_running":
                running[s.labels["worker"]] = s.value
    return Sample(t_s, queued, occupancy, running)


async def sample_metrics(
    client: httpx.AsyncClient, start: float, interval_s: float, stop: asyncio.Event, samples: list[Sample]
) -> None:
    """Append a Sample every `interval_s` until `stop` is set; a server without pdserve metrics gives none."""
    while not stop.is_set():
        try:
            response = await client.get("/metrics")
            if response.status_code == 200:
                samples.append(parse_sample(response.text, time.perf_counter() - start))
        except httpx.HTTPError:
            pass
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: a cancel is never lost (3.11's wait_for)
            async with asyncio.timeout(interval_s):
                await stop.wait()
