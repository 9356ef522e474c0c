"""The typed client one worker calls another through (worker_runtime/peer_client.py), over a stand-in for a
Ray actor handle: a reply comes back as it is, a failed call is a refused reply, and a release is sent."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kv_transfer import PullReply, PullRequest
from worker_runtime.peer_client import PeerClient

PULL = PullRequest("prefill-0", 7, "decode-0", 1)


class _Method:
    """What `handle.method` is on a Ray actor handle: `.remote(...)` answers an awaitable."""

    def __init__(self, call: Callable[..., Any]) -> None:
        self._call = call

    def remote(self, *args: Any) -> Any:
        return self._call(*args)


class _Handle:
    def __init__(self, accept_pull: Callable[[PullRequest], Any]) -> None:
        self.accept_pull = _Method(accept_pull)
        self.releases: list[tuple[int, str]] = []
        self.release_kv = _Method(lambda transfer_id, why: self.releases.append((transfer_id, why)))


def test_a_reply_comes_back_as_the_peer_gave_it() -> None:
    reply = PullReply("prefill-0", 7, is_accepted=True, reason="", send_seq=0, num_blocks=3)

    async def accept(pull: PullRequest) -> PullReply:
        return reply

    assert asyncio.run(PeerClient("prefill-0", _Handle(accept)).accept_pull(PULL)) == reply


def test_a_failed_call_is_a_refused_reply_not_an_error() -> None:
    async def accept(pull: PullRequest) -> PullReply:
        raise ConnectionError("the peer died")

    reply = asyncio.run(PeerClient("prefill-0", _Handle(accept)).accept_pull(PULL))
    assert (reply.source_worker_id, reply.transfer_id, reply.is_accepted) == ("prefill-0", 7, False)
    assert "ConnectionError" in reply.reason and reply.send_seq == -1 and reply.num_blocks == 0


def test_a_release_reaches_the_peer() -> None:
    handle = _Handle(lambda pull: None)
    PeerClient("prefill-0", handle).release_kv(7, "the pull failed")
    assert handle.releases == [(7, "the pull failed")]
