"""A real pdserve server (uvicorn, local Ray, tiny random Llama with SmolLM2's tokenizer) per test module."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.config import ServeConfig

API_KEY = "sk-test-key"
MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(config: ServeConfig, send_buffer_bytes: int | None = None) -> Iterator[tuple[str, FastAPI]]:
    """A real server on its own thread (uvicorn, the app's lifespan: Ray actors); yields (url, app).

    `send_buffer_bytes`: the kernel's send buffer of every connection (fixed: no autotuning to megabytes),
    so that a client that stops reading blocks the server's sends soon."""
    app = create_app(config)
    uv = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       lifespan="on"))
    sockets = None
    if send_buffer_bytes is not None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)  # accepted ones inherit
        listener.bind((config.host, config.port))
        sockets = [listener]
    thread = threading.Thread(target=lambda: uv.run(sockets=sockets), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("pdserve did not start")
        time.sleep(0.1)
    try:
        yield f"http://{config.host}:{config.port}", app
    finally:
        uv.should_exit = True
        thread.join(60)


def serve_config(model_dir: Path, **overrides: object) -> ServeConfig:
    settings: dict[str, object] = {
        # nixl where it imports, else the torch backend: the HTTP suite runs either way.
        # float32 on every CPU kind: the reference tokens are transformers' in float32.
        "model": str(model_dir), "dtype": "float32", "served_model_name": MODEL, "backend": "auto",
        "port": free_port(),
        "kv_cache_mib": 2,  # 64 blocks of 16 tokens per worker: small enough to overload on purpose
        "max_num_batched_tokens": 256, "api_key": API_KEY, "max_waiting": 1, "queue_timeout_s": 30,
    }
    return ServeConfig(**{**settings, **overrides})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    with serving(serve_config(tiny_chat_model_dir)) as (url, _):
        yield url


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


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


def two_stage_config(model_dir: Path, **overrides: object) -> ServeConfig:
    """1 prefill + 2 decode workers in float32, no API key: the OpenAI-surface suites' server (a forced
    migration has a second decode worker to go to)."""
    settings: dict[str, object] = {
        "dtype": "float32", "model": str(model_dir), "served_model_name": MODEL, "prefill": 1, "decode": 2,
        "port": free_port(), "kv_cache_mib": 2, "max_num_batched_tokens": 64, "max_waiting": 8,
        "queue_timeout_s": 30,
    }
    return ServeConfig(**{**settings, **overrides})  # type: ignore[arg-type]


@contextlib.contextmanager
def whole_after(url: str) -> Iterator[httpx.Client]:
    """A client of the server that checks, when the test is done, that no worker holds a KV block."""
    with httpx.Client(base_url=url, timeout=120) as c:
        yield c
        assert wait_until_no_blocks_used(c, timeout_s=20) == 0  # the fleet ends whole
