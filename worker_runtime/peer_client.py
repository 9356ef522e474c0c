"""The typed client a worker calls another worker through (a decode or mixed worker → a worker it pulls KV
from): carry a pull request to the sender and bring its reply back (backends whose sender takes part), and
tell the sender nobody will pull a handle. The one place that reaches a peer's Ray actor handle."""

from __future__ import annotations

import logging
from typing import Any

from kv_transfer import PullReply, PullRequest

logger = logging.getLogger(__name__)


class PeerClient:
    def __init__(self, worker_id: str, handle: Any) -> None:
        """Args:
        worker_id: the peer's worker id.
        handle: its Ray actor handle (pool_worker.actor.WorkerActor, which this layer may not import).
        """
        self.worker_id = worker_id
        self._handle = handle

    async def accept_pull(self, pull: PullRequest) -> PullReply:
        """The sender's reply to a pull. Never raises: a call that fails (the peer died, Ray lost it) is a
        refused reply, so that the pull ends now (its prompt recomputed) instead of at its deadline."""
        try:
            reply: PullReply = await self._handle.accept_pull.remote(pull)
        except Exception as error:
            logger.warning("pull %s from %s could not be carried (%s); it is refused", pull.transfer_id,
                           self.worker_id, type(error).__name__)
            return PullReply(pull.source_worker_id, pull.transfer_id, is_accepted=False,
                             reason=f"the pull request failed: {type(error).__name__}", send_seq=-1,
                             num_blocks=0)
        return reply

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer: the sender frees its blocks now. Fire and forget: if the peer is
        gone, so are its blocks."""
        self._handle.release_kv.remote(transfer_id, why)
