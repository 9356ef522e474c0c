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
def serving(config: ServeConfig) -> Iterator[tuple[str, FastAPI]]:
    """A real server on its own thread (uvicorn, the app's lifespan: Ray actors); yields (url, app)."""
    app = create_app(config)
    uv = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                       lifespan="on"))
    thread = threading.Thread(target=uv.run, daemon=True)
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


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    pytest.importorskip("nixl")
    config = ServeConfig(
        model=str(tiny_chat_model_dir), served_model_name=MODEL, backend="nixl", port=free_port(),
        kv_cache_mib=2,  # 64 blocks of 16 tokens per worker: small enough to overload on purpose
        max_num_batched_tokens=256, api_key=API_KEY, max_waiting=1, queue_timeout_s=30,
    )
    with serving(config) as (url, _):
        yield url


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


def used_blocks(client: httpx.Client) -> int:
    pools = client.get("/admin/pools").json()
    return sum(w["used_kv_blocks"] for w in pools["workers"])


def wait_until_no_blocks_used(client: httpx.Client, timeout_s: float = 10.0) -> int:
    used = -1
    for _ in range(int(timeout_s / 0.05)):
        used = used_blocks(client)
        if used == 0:
            break
        time.sleep(0.05)
    return used
