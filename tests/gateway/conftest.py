"""The gateway suites' servers: the default shape (serve_config: 1 prefill + 1 decode, an API key), shared by
every module that leaves the fleet whole and defines no `server` of its own (tests/helpers/servers.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import API_KEY, SHARED, shared_default_config, whole_after


# The function's name tells tests/conftest.py which shared shape a test uses (to run them together).
@pytest.fixture(scope="module", name="server")
def shared_default_server(tiny_chat_model_dir: Path, ray_local: None) -> str:
    return SHARED.url("default", lambda: shared_default_config(tiny_chat_model_dir))


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    """A client with the API key; after the test, no KV block is held and every worker is active."""
    with whole_after(server, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c
