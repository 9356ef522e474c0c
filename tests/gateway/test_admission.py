"""Admission without Ray: capacity in tokens, a line bounded in requests and in tokens, capacity that follows
the live decode workers, and a reservation that is returned however the request ends."""

from __future__ import annotations

import asyncio

import pytest

from gateway.requests.admission import Admission, Overloaded


def test_line_is_bounded_in_requests_and_in_tokens() -> None:
    async def scenario() -> None:
        admission = Admission(capacity_tokens=100, max_waiting=3, timeout_s=30, max_waiting_tokens=150)
        held = await admission.acquire(100)
        first = asyncio.create_task(admission.acquire(90))  # waits: the line holds 90 tokens
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="tokens already wait") as refused:
            await admission.acquire(70)  # 90 + 70 > 150 tokens in line
        assert refused.value.retry_after_s >= 1
        second = asyncio.create_task(admission.acquire(50))
        third = asyncio.create_task(admission.acquire(5))
        await asyncio.sleep(0)
        assert admission.num_waiting == 3 and admission.waiting_tokens == 145
        with pytest.raises(Overloaded, match="requests already wait"):
            await admission.acquire(1)  # the line is full in requests
        held.release()
        granted = await first
        assert admission.reserved_tokens == 90 and admission.waiting_tokens == 55
        granted.release()
        for task in (second, third):
            (await task).release()
        assert admission.reserved_tokens == 0 and admission.num_waiting == 0 and admission.waiting_tokens == 0

    asyncio.run(scenario())


def test_capacity_follows_the_live_decode_workers() -> None:
    async def scenario() -> None:
        admission = Admission(capacity_tokens=200, max_waiting=8, timeout_s=30)
        held = await admission.acquire(150)
        admission.set_capacity(100)  # a decode worker failed: its share is gone
        waiting = asyncio.create_task(admission.acquire(50))
        await asyncio.sleep(0)
        assert admission.num_waiting == 1
        admission.set_capacity(200)  # its replacement is up: the line moves at once
        (await waiting).release()
        held.release()
        assert admission.reserved_tokens == 0

    asyncio.run(scenario())


def test_a_wait_past_the_timeout_or_a_cancelled_wait_leaves_the_line() -> None:
    async def scenario() -> None:
        admission = Admission(capacity_tokens=10, max_waiting=8, timeout_s=0.05)
        held = await admission.acquire(10)
        with pytest.raises(Overloaded, match="within"):
            await admission.acquire(5)
        gone = asyncio.create_task(admission.acquire(5))
        await asyncio.sleep(0)
        gone.cancel()  # the client left while waiting
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert admission.num_waiting == 0 and admission.waiting_tokens == 0
        held.release()
        held.release()  # idempotent
        assert admission.reserved_tokens == 0

    asyncio.run(scenario())


def test_try_acquire_never_jumps_the_line() -> None:
    async def scenario() -> None:
        admission = Admission(capacity_tokens=100, max_waiting=3, timeout_s=30)
        held = admission.try_acquire(60)
        assert held is not None and admission.reserved_tokens == 60
        assert admission.try_acquire(50) is None  # no room: the caller must wait in line
        waiting = asyncio.create_task(admission.acquire(50))
        await asyncio.sleep(0)
        assert admission.try_acquire(10) is None  # room for 10, but someone waits first
        await held.release_at_stream_end()
        (await waiting).release()
        assert admission.reserved_tokens == 0 and admission.num_waiting == 0

    asyncio.run(scenario())
