"""A streaming client that stops reading (M2), on a real server (1 prefill + 1 decode worker, tiny Llama):
its admission reservation is released when the worker is done, not when the client has read the stream, and
past its deadline the stalled connection is cut."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from gateway.requests.deadlines import DeadlinePolicy
from tests.helpers.reference import random_prompts
from tests.helpers.servers import API_KEY, MODEL, serve_config, serving, wait_until_no_blocks_used

pytestmark = pytest.mark.slow
VOCAB = 49152


@pytest.fixture(scope="module")
def delivery_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[tuple[str, FastAPI]]:
    # One decode worker of 64 blocks: one 620-token request takes nearly all of the admission capacity.
    config = serve_config(tiny_chat_model_dir, prefill=1, decode=1, max_waiting=4, queue_timeout_s=60)
    with serving(config, send_buffer_bytes=4096) as running:
        yield running


def stalled_stream(url: str, body: dict[str, object]) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer, and never read it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # before connect: the window stays small
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    return sock


def big_stream(seed: int) -> dict[str, object]:
    # ~250 bytes per token (logprobs and token ids on every chunk): ~150 KB, well past the socket buffers.
    return {"model": MODEL, "prompt": random_prompts([20], VOCAB, seed=seed)[0], "max_tokens": 600,
            "ignore_eos": True, "stream": True, "logprobs": 0, "return_token_ids": True}


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError("condition never held")


def streamed_token_ids(data: bytes) -> int:
    """How many token ids a raw SSE stream carried, summed over its events: an event may carry more than one
    (seen once under the full suite's load: 599 events for 600 tokens)."""
    return sum(len(ids.split(b",")) for ids in re.findall(rb'"token_ids":\[([0-9,]+)\]', data))


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    data = []
    try:
        while chunk := sock.recv(65536):
            data.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(data)


def test_a_client_that_stops_reading_releases_its_reservation_when_the_worker_is_done(
        delivery_server: tuple[str, FastAPI]) -> None:
    url, app = delivery_server
    admission = app.state.service.admission
    sock = stalled_stream(url, big_stream(seed=1))
    try:
        wait_for(lambda: admission.reserved_tokens == 620)
        # Another request needs the capacity the stalled one reserved: it gets it once that one's worker is
        # done, while the stalled client still has most of its stream unread.
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
            response = c.post("/v1/completions", json={**big_stream(seed=2), "stream": False})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 600
            assert admission.reserved_tokens == 0
            assert wait_until_no_blocks_used(c) == 0
        data = read_to_end(sock)  # the stalled stream is still whole
        assert b"data: [DONE]" in data
        assert streamed_token_ids(data) == 600
    finally:
        sock.close()


def test_a_stalled_reader_is_cut_past_its_deadline(delivery_server: tuple[str, FastAPI]) -> None:
    url, app = delivery_server
    service = app.state.service
    stalled = service.metrics.stalled_streams
    service.deadline_policy = DeadlinePolicy(slack_s=30.0, prefill_s_per_token=0.0, decode_s_per_token=0.0)
    service.delivery_grace_s = -59.0  # send_by: 1 s after admission, long before the stream is read
    try:
        sock = stalled_stream(url, big_stream(seed=3))
        try:
            wait_for(lambda: stalled._value.get() == 1)
            data = read_to_end(sock)
        finally:
            sock.close()
    finally:
        service.deadline_policy = DeadlinePolicy()
        service.delivery_grace_s = 30.0
    assert b"[DONE]" not in data  # cut, not finished
    wait_for(lambda: service.admission.reserved_tokens == 0)
