"""The port answers while the fleet starts: GET /health says "starting" and how far each worker has come;
every other request gets 503 with a sentence, not a refused connection.

    `pdserve serve` → Ray → with answering_while_starting(config, progress): the fleet starts (minutes on a
    cluster: Ray places each worker, each loads the model) → the answerer closes its socket → uvicorn binds
    the same port and serves (the gap is uvicorn's bind, milliseconds).

uvicorn binds its socket only once the app's lifespan start-up is over (and the frontends of
--api-server-count bind once the fleet actor is up), so until then the port is free and this small server
holds it. It is the standard library's threading HTTP server on a thread of its own: start-up's event loop
is busy starting the fleet, and nothing here must wait for it. TLS as the real server's (--ssl-*), so a
client's https probe reads the answer too.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gateway.config import ServeConfig
from gateway.fleet.bring_up_log import StartProgress

RETRY_AFTER_S = 5  # what the 503's Retry-After header says


Progress = Callable[[], StartProgress | None]  # None: not known yet (the workers are not created)


def starting_body(progress: StartProgress | None, began: float) -> dict[str, Any]:
    if progress is None:
        return StartProgress(elapsed_s=round(time.monotonic() - began, 1), loaded=0, total=0).model_dump()
    return progress.model_dump()


def refusal_message(progress: StartProgress | None) -> str:
    done = f": {progress.loaded} of {progress.total} workers loaded" if progress and progress.total else ""
    return f"pdserve is starting{done}; retry when GET /health answers 200"


class _Handler(BaseHTTPRequestHandler):
    server: _AnsweringServer
    protocol_version = "HTTP/1.1"
    timeout = 10  # a connection that sends nothing is closed, not held past close()

    def _answer(self) -> None:
        try:
            progress = self.server.progress()
        except Exception:  # a progress source that fails must not turn the answer into a dropped connection
            progress = None
        if self.path.split("?")[0].rstrip("/").endswith("/health"):
            body: dict[str, Any] = starting_body(progress, self.server.began)
        else:
            body = {"error": {"message": refusal_message(progress), "type": "ServiceUnavailableError",
                              "param": None, "code": 503}}
        data = json.dumps(body).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", str(RETRY_AFTER_S))
        # One answer a connection: a client keeping it alive (a load balancer's probe) would otherwise go on
        # asking this server, on its handler's thread, after the real one has taken the port.
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _answer_with_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:  # read what was sent, so that the connection stays usable for the next request
            self.rfile.read(min(length, 1 << 20))
        self._answer()

    do_GET = do_HEAD = _answer
    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer_with_body

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a probe every few seconds would fill the start-up log


class _AnsweringServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # uvicorn binds the same port right after (it sets SO_REUSEADDR too)

    def __init__(self, address: tuple[str, int], progress: Progress, is_ipv6: bool) -> None:
        self.address_family = socket.AF_INET6 if is_ipv6 else socket.AF_INET
        self.progress = progress
        self.began = time.monotonic()
        super().__init__(address, _Handler)


def tls_context(config: ServeConfig) -> ssl.SSLContext | None:
    if not config.ssl_certfile:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(config.ssl_certfile, config.ssl_keyfile)
    if config.ssl_ca_certs:
        context.load_verify_locations(config.ssl_ca_certs)
    context.verify_mode = ssl.VerifyMode(config.ssl_cert_reqs)
    return context


class StartAnswerer:
    """Answers on config's host and port from construction until close() (see the module docstring). A port
    that cannot be bound is left alone: uvicorn's own bind says why once start-up is over."""

    def __init__(self, config: ServeConfig, progress: Progress) -> None:
        self._server: _AnsweringServer | None = None
        try:
            server = _AnsweringServer((config.host, config.port), progress, ":" in config.host)
        except OSError as error:
            print(f"pdserve: the port does not answer while starting ({error})", flush=True)
            return
        context = tls_context(config)
        if context is not None:
            # The handshake on the handler's thread, not in accept(): a slow client must not hold the others.
            server.socket = context.wrap_socket(server.socket, server_side=True,
                                                do_handshake_on_connect=False)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="start-answerer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Free the port (at once: the next bind is uvicorn's); again is a no-op."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)


@contextmanager
def answering_while_starting(config: ServeConfig, progress: Progress) -> Iterator[None]:
    answerer = StartAnswerer(config, progress)
    try:
        yield
    finally:
        answerer.close()
