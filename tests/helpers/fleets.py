"""Deployments of real worker actors driven from the test (no HTTP server): one started per scenario, and the
calls a scenario makes on it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.workers import Worker
from gateway.requests.events import StreamEvent
from gateway.requests.orchestrator import run_request
from gateway.requests.router import Router
from llm_engine import EngineConfig, SamplingParams
from worker_runtime.roles import Role


def config_for(model_dir: Path, max_num_batched_tokens: int = 512,
               role_resources: dict[Role, dict[str, float]] | None = None, **layout: int) -> DeploymentConfig:
    pytest.importorskip("nixl")
    engine = EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=16 << 20,
                          max_num_batched_tokens=max_num_batched_tokens)
    # A role no node offers resources for stays PENDING: start-up goes on without it once the others are
    # placed (no live node can take it).
    return DeploymentConfig(engine, backend="nixl", role_resources=role_resources or {},
                            **layout)  # type: ignore[arg-type]


def with_deployment(model_dir: Path, scenario: Callable[[PDDeployment, Router], Awaitable[Any]],
                    **layout: Any) -> Any:
    async def run() -> Any:
        deployment = PDDeployment(config_for(model_dir, **layout))
        await deployment.start()
        try:
            return await scenario(deployment, Router(deployment))
        finally:
            await deployment.shutdown()

    return asyncio.run(run())


async def until(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the condition never held")


async def call_on(worker: Worker, fn: Callable[..., Any], *args: Any) -> Any:
    return await worker.client.handle.__ray_call__.remote(fn, *args)


async def events_of(router: Router, request_id: str, prompt: list[int], sampling: SamplingParams
                    ) -> list[StreamEvent]:
    return [e async for e in run_request(router, request_id, tuple(prompt), sampling)]


def tokens(events: list[StreamEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]
