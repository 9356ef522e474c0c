"""Fixtures of the OpenAI-surface suites that share one server shape (two_stage_config: 1 prefill + 2 decode,
float32): a module's server, the openai SDK on it, and a client that checks the fleet ends whole. A test
module imports the three names; pytest finds fixtures among a module's globals."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.conftest import serving, two_stage_config, whole_after


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    with serving(two_stage_config(tiny_chat_model_dir)) as (url, _):
        yield url


@pytest.fixture
def sdk(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:
        yield c
