"""The run's HTTP client, and which local port each request's connection had.

With several frontends (`--api-server-count N`) every request opens its own connection (no keep-alive): the
frontends accept on one shared socket, so fresh connections spread over them, and a request's connection is
one TCP port that names the frontend holding it (chaoslib/frontends.py FrontendMap). A request
records that port through `PORTS` (set by its task): a connection cut by a frontend fault is then told
from one cut for no reason.
"""

from __future__ import annotations

import contextvars
from typing import Any

import httpcore
import httpx

# The current request's local ports, one per connection it opened (the task that sends it sets the list).
PORTS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("chaos_ports", default=None)


class PortRecordingBackend(httpcore.AsyncNetworkBackend):
    """httpcore's default backend, noting each new connection's local port in PORTS' list."""

    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        ports = PORTS.get()
        address = stream.get_extra_info("client_addr")
        if ports is not None and address:
            ports.append(int(address[1]))
        return stream

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> httpcore.AsyncNetworkStream:
        return await self._inner.connect_unix_socket(path, timeout, socket_options)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


def chaos_client(url: str, headers: dict[str, str], has_frontends: bool) -> httpx.AsyncClient:
    """One process: a pool of kept-alive connections (as before). Several frontends: a fresh connection per
    request, each one's port recorded."""
    if not has_frontends:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        return httpx.AsyncClient(base_url=url, timeout=None, limits=limits, headers=headers)
    transport = httpx.AsyncHTTPTransport()
    # httpx takes no network backend; its transport is a thin wrapper over this pool (errors mapped there).
    transport._pool = httpcore.AsyncConnectionPool(max_connections=None, max_keepalive_connections=0,
                                                   network_backend=PortRecordingBackend())
    return httpx.AsyncClient(base_url=url, timeout=None, transport=transport, headers=headers)
