"""While the fleet starts, the port answers (gateway/start_answerer.py): GET /health is 503 with how far each
worker has come, any other request a 503 with a sentence and Retry-After, over plain HTTP and TLS, one
answer a connection; once closed, the port is free at once for uvicorn's bind. A real server on a real
socket; the progress comes from a real BringUpLog (its phases are tested in test_bring_up_log.py). The
whole server's start, with both frontends, is in tests/gateway/test_frontends.py."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

import httpx

from gateway.config import ServeConfig
from gateway.fleet.bring_up_log import StartProgress, WorkerStart
from gateway.start_answerer import StartAnswerer
from tests.helpers.servers import free_port
from tests.helpers.tls import self_signed

PROGRESS = StartProgress(elapsed_s=12.5, loaded=1, total=2, workers=[
    WorkerStart(worker_id="w-0", role="prefill", phase="loaded", node_ip="10.0.0.7", since_created_s=12.0),
    WorkerStart(worker_id="w-1", role="decode", phase="created", since_created_s=12.0)])


def config(port: int, **fields: object) -> ServeConfig:
    return ServeConfig.model_validate({"host": "127.0.0.1", "port": port, **fields})


def test_health_says_starting_and_every_other_request_gets_a_503_that_says_why() -> None:
    port = free_port()
    answerer = StartAnswerer(config(port), lambda: PROGRESS)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            health = client.get("/health")
            assert health.status_code == 503
            assert health.json() == PROGRESS.model_dump()
            refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
            assert refused.json()["error"]["message"] == ("pdserve is starting: 1 of 2 workers loaded; retry "
                                                          "when GET /health answers 200")
            # One answer a connection: a kept-alive one would go on reaching this server after close().
            assert refused.headers["connection"] == "close" and health.headers["connection"] == "close"
            assert client.get("/v1/models").status_code == 503
    finally:
        answerer.close()
    answerer.close()  # again: nothing
    with socket.create_server(("127.0.0.1", port)):  # free at once for uvicorn's bind
        pass


def test_before_any_worker_exists_and_when_the_progress_source_fails_it_still_answers() -> None:
    port = free_port()
    answers = iter([None])

    def progress() -> StartProgress | None:
        return next(answers)  # the second call raises StopIteration: a failing source

    answerer = StartAnswerer(config(port), progress)
    try:
        for _ in range(2):
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert health.status_code == 503
            assert health.json()["status"] == "starting" and health.json()["total"] == 0
    finally:
        answerer.close()


def test_over_tls_with_the_servers_certificate(tmp_path: Path) -> None:
    keyfile, certfile = self_signed(tmp_path)
    port = free_port()
    answerer = StartAnswerer(config(port, ssl_keyfile=str(keyfile), ssl_certfile=str(certfile)),
                             lambda: PROGRESS)
    try:
        verify = ssl.create_default_context(cafile=str(certfile))
        health = httpx.get(f"https://127.0.0.1:{port}/health", timeout=10, verify=verify)
        assert health.status_code == 503 and health.json()["loaded"] == 1
    finally:
        answerer.close()


def test_a_port_already_taken_is_left_to_uvicorn_to_report() -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        answerer = StartAnswerer(config(port), lambda: None)  # says so in the log, does not raise
        answerer.close()
