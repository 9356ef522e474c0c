"""Real pdserve servers for the tests (uvicorn on a thread, the app's lifespan: a fleet of Ray actors on the
tiny random Llama with SmolLM2's tokenizer), their settings, and the checks that a fleet ends whole.

A fleet start costs 20–35 s on 2 cores, so the suites that leave the fleet whole share one server per shape
(`SharedServers`): tests/conftest.py runs the modules of one shape one after another and closes the server
when the next test asks for another shape or for none (at most one shared fleet lives at a time, so the
suites that count the free CPUs of the local Ray see what they saw before). Each shared client checks after
every test that no KV block is held and every worker is active (`whole_after`): a test that leaks fails
itself, not the next module."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
import uvloop
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import ServeConfig
from gateway.fleet_supervisor import fleet_started

API_KEY = "sk-test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(config: ServeConfig, send_buffer_bytes: int | None = None,
            starting_answers: list[dict[str, Any]] | None = None, start_timeout_s: float = 120.0
            ) -> Iterator[tuple[str, FastAPI]]:
    """A real server on its own thread, as `pdserve serve` runs it with one frontend: the fleet actor in the
    test's Ray (gateway/frontends.py fleet_started), the frontend's uvicorn in this process (its lifespan
    joins the fleet); yields (url, app). app.state.control is the fleet actor's FleetClient.

    `send_buffer_bytes`: the kernel's send buffer of every connection (fixed: no autotuning to megabytes),
    so that a client that stops reading blocks the server's sends soon.
    `starting_answers`: collects GET /health's 503 bodies while the server starts (gateway/start_answerer.py).
    """
    sockets = None
    if send_buffer_bytes is not None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)  # accepted ones inherit
        sockets = [listener]
    running: list[uvicorn.Server] = []
    apps: list[FastAPI] = []
    failed: list[BaseException] = []
    loops: list[asyncio.AbstractEventLoop] = []

    def run() -> None:
        try:
            with fleet_started(config) as fleet:
                app = create_app(config, fleet.spec, on_ready=fleet.ready)
                # Its graceful stop is bounded as the product's is (gateway/serve_settings.py).
                uv = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                                   log_level="warning", lifespan="on",
                                                   timeout_graceful_shutdown=config.shutdown_grace_s))
                apps.append(app)
                running.append(uv)
                if sockets is not None:  # bound once the start answerer has let the port go
                    fleet.ready()
                    sockets[0].bind((config.host, config.port))
                # uvicorn's own run() on a loop this helper holds: one that does not stop can be stopped.
                loop = uvloop.new_event_loop()
                loops.append(loop)
                try:
                    loop.run_until_complete(uv.serve(sockets=sockets))
                finally:
                    loop.close()
        except BaseException as error:
            failed.append(error)
            raise

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not (running and running[0].started):
        if not thread.is_alive() or time.monotonic() > deadline:
            if running:
                running[0].should_exit = True
            raise RuntimeError(f"pdserve did not start: {failed[0]!r}" if failed else "pdserve did not start")
        if starting_answers is not None:
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"http://{config.host}:{config.port}/health", timeout=2)
                if health.status_code == 503:
                    starting_answers.append(health.json())
        time.sleep(0.1)
    try:
        yield f"http://{config.host}:{config.port}", apps[0]
    finally:
        running[0].should_exit = True
        # The fleet's shutdown stops every worker (a replacement still loading, too): the next server must
        # not start before their CPUs are Ray's again, or it waits for a placement that never comes.
        thread.join(config.shutdown_grace_s + STOP_MARGIN_S)
        if thread.is_alive():  # as the product's supervisor ends a frontend that outlives its grace
            _stop_stuck(loops[0])
            thread.join(60)
        if thread.is_alive():
            raise RuntimeError("pdserve did not stop, even with its event loop stopped")
        wait_for_ray_cpus()


STOP_MARGIN_S = 60.0  # past the server's shutdown grace: its lifespan's own shutdown (the fleet's workers)


def _stop_stuck(loop: asyncio.AbstractEventLoop) -> None:
    """Stop a test server's loop that did not stop by itself (its thread then stops the fleet), warning with
    where each of its tasks waits: that is a shutdown that hangs, to be found."""
    stacks = []
    for task in list(asyncio.all_tasks(loop)):  # read from this thread: a diagnosis, not a control path
        where, awaited = [], task.get_coro()
        while awaited is not None and (frame := getattr(awaited, "cr_frame", None)) is not None:
            code = frame.f_code
            where.append(f"{code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {code.co_name}")
            awaited = getattr(awaited, "cr_await", None)  # down the chain of awaits to where it waits
        stacks.append(f"{task.get_name()}: {' -> '.join(where)}")
    warnings.warn("a test server did not stop within its grace; its loop was stopped. Its tasks:\n"
                  + "\n".join(stacks), stacklevel=2)
    loop.call_soon_threadsafe(loop.stop)


def fleet_output(app: FastAPI) -> str:
    """What the server's fleet actor printed (its workers' bring-up lines, their KV): the tests' Ray does not
    forward a worker's output to the driver, so it is read from Ray's log of the actor's process."""
    import os

    import ray

    pid = ray.get(app.state.control.handle.__ray_call__.remote(lambda _: os.getpid()))
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return "".join(path.read_text() for path in sorted(logs.glob(f"worker-*-{pid}.out")))


def wait_for_ray_cpus(timeout_s: float = 60.0) -> None:
    """Until every CPU of the local Ray is free again (its workers' actors are reaped a little after)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0):
            return
        time.sleep(0.2)
    raise RuntimeError(f"Ray's CPUs not all free {timeout_s:g} s after a server stopped: "
                       f"{ray.available_resources().get('CPU', 0.0)} of {ray.cluster_resources().get('CPU')}")


def serve_config(model_dir: Path, **overrides: object) -> ServeConfig:
    """The default shape: 1 prefill + 1 decode, an API key, a queue of one (easy to overload on purpose)."""
    settings: dict[str, object] = {
        # nixl where it imports, else the torch backend: the HTTP suite runs either way.
        # float32 on every CPU kind: the reference tokens are transformers' in float32.
        "model": str(model_dir), "dtype": "float32", "served_model_name": MODEL, "backend": "auto",
        "port": free_port(),
        "kv_cache_mib": 2,  # 64 blocks of 16 tokens per worker: small enough to overload on purpose
        "max_num_batched_tokens": 256, "api_key": API_KEY, "max_waiting": 1, "queue_timeout_s": 30,
    }
    return ServeConfig(**{**settings, **overrides})  # type: ignore[arg-type]


# Chat requests that name no max_tokens generate this many on the shared default server (the flag's default is
# 512): the schema fuzz sends such requests and keeps them cheap; no suite on that server asks for the 512.
SHARED_DEFAULT_MAX_TOKENS = 4


def shared_default_config(model_dir: Path) -> ServeConfig:
    """The shared server of the default shape (tests/gateway/conftest.py); its responses show the prompt
    tokens found cached (the two-stage server keeps the default: they do not)."""
    return serve_config(model_dir, default_max_tokens=SHARED_DEFAULT_MAX_TOKENS,
                        enable_prompt_tokens_details=True)


def two_stage_config(model_dir: Path, **overrides: object) -> ServeConfig:
    """1 prefill + 2 decode workers in float32, no API key: the OpenAI-surface suites' server (a forced
    migration has a second decode worker to go to)."""
    settings: dict[str, object] = {
        "dtype": "float32", "model": str(model_dir), "served_model_name": MODEL, "prefill": 1, "decode": 2,
        "port": free_port(), "kv_cache_mib": 2, "max_num_batched_tokens": 64, "max_waiting": 8,
        "queue_timeout_s": 30,
    }
    return ServeConfig(**{**settings, **overrides})  # type: ignore[arg-type]


def used_blocks(client: httpx.Client) -> int:
    pools = client.get("/admin/pools").json()
    return sum(w.get("used_kv_blocks", 0) for w in pools["workers"])  # a starting worker has no load yet


def wait_until_no_blocks_used(client: httpx.Client, timeout_s: float = 10.0) -> int:
    used = -1
    for _ in range(int(timeout_s / 0.05)):
        used = used_blocks(client)
        if used == 0:
            break
        time.sleep(0.05)
    return used


def not_whole(client: httpx.Client) -> str | None:
    """What keeps the fleet from being whole (a worker not active, one missing, KV blocks held), or None."""
    health = client.get("/health").json()
    if health["status"] != "ok" or health["active_workers"] != health["target_workers"]:
        return f"/health: {health}"
    workers = client.get("/admin/pools").json()["workers"]
    if [w for w in workers if w["state"] != "active"]:
        return f"workers not active: {[(w['worker_id'], w['state']) for w in workers]}"
    if used := sum(w.get("used_kv_blocks", 0) for w in workers):
        return f"{used} KV blocks held"
    if booked := {w["worker_id"]: w["tokens_on_the_way"] for w in workers if w.get("tokens_on_the_way")}:
        return f"the gateway's books still count tokens on their way to {booked}"  # a drain would wait
    return None


def wait_until_whole(client: httpx.Client, timeout_s: float = 180.0) -> str | None:
    """Waits (a replaced worker takes a model load to come back) until the fleet is whole; returns None, or
    what still keeps it from being whole at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (problem := not_whole(client)) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return problem


@contextlib.contextmanager
def whole_after(url: str, headers: dict[str, str] | None = None) -> Iterator[httpx.Client]:
    """A client of the server that checks, when the test is done, that no worker holds a KV block and every
    worker is active."""
    with httpx.Client(base_url=url, timeout=120, headers=headers) as c:
        yield c
        assert wait_until_no_blocks_used(c, timeout_s=20) == 0  # the fleet ends whole
        assert wait_until_whole(c) is None, wait_until_whole(c, timeout_s=0)


def burst(server: str, body: dict, count: int) -> list[httpx.Response]:
    """`count` identical completions sent at the same moment."""

    async def send_all() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server, headers=headers, timeout=120) as aclient:
            posts = (aclient.post("/v1/completions", json=body) for _ in range(count))
            return list(await asyncio.gather(*posts))

    return asyncio.run(send_all())


class SharedServers:
    """At most one shared server, of the shape the running tests ask for; another shape closes it first."""

    def __init__(self) -> None:
        self.shape: str | None = None
        self._url = ""
        self._stack = contextlib.ExitStack()

    def url(self, shape: str, config: Callable[[], ServeConfig]) -> str:
        """The url of the shared server of `shape` (a name for the settings `config` builds); started here
        when another shape's or none is running."""
        if shape != self.shape:
            self.close()
            self._url, _ = self._stack.enter_context(serving(config()))
            self.shape = shape
        return self._url

    def close(self) -> None:
        self._stack.close()
        self.shape = None


SHARED = SharedServers()
