"""Deployments of real worker actors driven from the test (no HTTP server): one started per scenario
(with_deployment), or one shared by the scenarios that leave it as they found it (SharedDeployment), and the
calls a scenario makes on it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.workers import Worker, WorkerState
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


class SharedDeployment:
    """One deployment of a shape, started once for several scenarios, on an event loop of its own (a thread,
    as the deployment's tasks and actor calls are bound to one loop). Each scenario gets a fresh Router; after
    it the deployment must be as it started — every worker ACTIVE in its first role, holding no request and
    no KV block — or the scenario fails (a scenario that changes roles puts them back itself)."""

    def __init__(self, model_dir: Path, **layout: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="shared-deployment", daemon=True)
        self._thread.start()
        self.deployment = PDDeployment(config_for(model_dir, **layout))
        self._call(self.deployment.start())
        self.roles = {w.worker_id: w.role for w in self.deployment.workers.values()}

    def _call(self, coroutine: Awaitable[Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()  # type: ignore[arg-type]

    def run(self, scenario: Callable[[PDDeployment, Router], Awaitable[Any]]) -> Any:
        return self._call(self._run(scenario))

    async def _run(self, scenario: Callable[[PDDeployment, Router], Awaitable[Any]]) -> Any:
        router = Router(self.deployment)
        try:
            result = await scenario(self.deployment, router)
        finally:
            self.deployment.on_remove.remove(router.forget)
        await self._check_as_started()
        return result

    async def _check_as_started(self) -> None:
        workers = list(self.deployment.workers.values())
        states = {w.worker_id: (w.state, w.role) for w in workers}
        assert states == {w: (WorkerState.ACTIVE, role) for w, role in self.roles.items()}, states
        for worker in workers:  # a request that just ended may still be leaving the worker
            for _ in range(500):
                if (await worker.client.load()).num_requests == 0 and await worker.client.is_whole():
                    break
                await asyncio.sleep(0.02)
            else:
                load = await worker.client.load()
                raise AssertionError(f"{worker.worker_id} holds requests or KV blocks after the scenario: "
                                     f"{load.num_requests} requests, {load.num_running} running, "
                                     f"{load.num_transferring} transferring, {load.num_waiting} waiting, "
                                     f"{load.num_free_blocks} of {load.num_total_blocks} blocks free")

    def close(self) -> None:
        try:
            self._call(self.deployment.shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)


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
