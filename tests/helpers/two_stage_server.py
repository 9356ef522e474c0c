"""Fixtures of the OpenAI-surface suites that share one server shape (two_stage_config: 1 prefill + 2 decode,
float32): the shared server, the openai SDK on it, and a client that checks the fleet ends whole. A test
module imports the three names; pytest finds fixtures among a module's globals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers.servers import SHARED, two_stage_config, whole_after


# The function's name tells tests/conftest.py which shared shape a test uses (to run them together).
@pytest.fixture(scope="module", name="server")
def shared_two_stage_server(tiny_chat_model_dir: Path, ray_local: None) -> str:
    return SHARED.url("two_stage", lambda: two_stage_config(tiny_chat_model_dir))


@pytest.fixture
def sdk(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:
        yield c
