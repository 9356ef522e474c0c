"""A batch of prompts (/v1/completions with a list) runs its prompts concurrently: when one fails, the
others are cancelled rather than left generating for nobody (review LOW item; asyncio.gather left them)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.api.disconnect import all_or_none
from gateway.requests.events import RequestFailed


def test_the_first_failure_cancels_the_rest_and_raises_as_itself() -> None:
    cancelled: list[str] = []

    async def long(name: str) -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(name)
            raise
        return name

    async def failing() -> str:
        await asyncio.sleep(0.01)
        raise RequestFailed("no decode worker is alive and none is starting", "no_worker")

    async def scenario() -> None:
        assert await all_or_none([asyncio.sleep(0, "a"), asyncio.sleep(0, "b")]) == ["a", "b"]
        with pytest.raises(RequestFailed, match="no decode worker"):
            await all_or_none([long("x"), failing(), long("y")])

    asyncio.run(scenario())
    assert sorted(cancelled) == ["x", "y"]
