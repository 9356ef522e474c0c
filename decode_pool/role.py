"""The decode role of a worker process (also the mixed role: a decode worker that is sent prompts without
a KV handle prefills them itself). Tokens go back through the worker actor's OutputChannels: each step's
outputs leave in one message per gateway, not one per request; the DecodeWorker's step loop runs on its own
thread.

Lifecycle:  DecodeRole(engine, outputs) — the engine's scheduler becomes the decode scheduler (with the
    admission watermark), a KV receiver is built and registered over the engine's KV cache (and, where the
    backend allows, a KV sender too, to offer evacuated streams' KV: decode_pool.migration), the step loop
    starts → add_peer() / submit() / abort() / evacuate() / release_kv() → close(): the loop stops, the
    receiver and sender deregister.
    Peers are the workers this one may pull KV from: every prefill worker, and every other decode or mixed
    worker where migration is possible.
    The engine (weights, KV cache) outlives the role: the worker actor (pool_worker) builds another role
    over it when the worker changes role.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from decode_pool.messages import DecodeRequest
from decode_pool.migration import MigrationOffers
from decode_pool.worker import DecodeWorker
from kv_transfer import (
    KVHandle,
    PeerInfo,
    PullReply,
    PullRequest,
    TransferConfig,
    TransferRecord,
    can_move_kv_between_decode_workers,
    make_receiver,
    make_sender,
)
from llm_engine import LLMEngine
from llm_engine.scheduler import Scheduler
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.step_loop import StepLoop

logger = logging.getLogger(__name__)


class DecodeRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: str, transfer_config: TransferConfig,
                 outputs: OutputChannels, watermark: float = 0.05, num_threads: int = 1) -> None:
        engine.use_scheduler(Scheduler, watermark)
        receiver = make_receiver(backend, worker_id, engine.runner.kv_cache, config=transfer_config)
        migration = None
        if can_move_kv_between_decode_workers(backend):
            migration = MigrationOffers(make_sender(backend, worker_id, engine.runner.kv_cache,
                                                    config=transfer_config), engine.kv)
        self.outputs = outputs
        self.worker = DecodeWorker(worker_id, engine, receiver, deliver_pull=self._deliver_pull,
                                   release_source=self._release_source, on_step_end=outputs.flush,
                                   wake=lambda: self.loop.wake(), migration=migration)
        self._peer_actors: dict[str, Any] = {}  # id of a worker this one pulls from → its actor handle
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.loop = StepLoop(f"decode-{worker_id}", self.worker.step, num_threads, on_error=self.worker.fail)
        self.loop.start()
        self.worker.start_watching()

    async def add_peer(self, peer: PeerInfo, actor: Any = None) -> None:
        """Learn a worker to pull from (once); `actor` is told about handles nobody will pull, and carries
        pulls where the sender takes part."""
        self._event_loop = asyncio.get_running_loop()
        self._peer_actors[peer.worker_id] = actor
        self.worker.add_peer(peer)
        self.loop.wake()

    def remove_peer(self, worker_id: str) -> None:
        """A worker left its role or the deployment: forget its endpoint."""
        self._peer_actors.pop(worker_id, None)
        self.worker.remove_peer(worker_id)
        self.loop.wake()

    def submit(self, request: DecodeRequest, channel_id: str) -> None:
        """Start the request; its outputs go to the output channel `channel_id`. Raises ValueError (it can
        never be served here) or WorkerFailed (the step loop died)."""
        self._event_loop = asyncio.get_running_loop()
        for output_id in request.output_request_ids:  # several choices stream under their own ids
            self.outputs.subscribe(output_id, channel_id)
        try:
            self.worker.submit(request, self.outputs.collect)
        except BaseException:
            for output_id in request.output_request_ids:
                self.outputs.unsubscribe(output_id)
            raise
        self.loop.wake()

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self.loop.wake()

    def evacuate(self) -> None:
        """End every request here with finish_reason "migrate" (the gateway continues them elsewhere)."""
        self.worker.evacuate()
        self.loop.wake()

    def move_out(self, request_ids: list[str]) -> None:
        """Hand these running streams back with their KV offered (the gateway continues them elsewhere)."""
        self.worker.move_out(request_ids)
        self.loop.wake()

    def peer_info(self) -> PeerInfo:
        """What other decode workers need to pull evacuated streams' KV from this one."""
        if self.worker.migration is None:
            raise RuntimeError("this transfer backend cannot move KV between decode workers")
        return self.worker.migration.peer_info()

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this evacuated stream's KV: free its blocks now."""
        self.worker.release(transfer_id, why)
        self.loop.wake()

    def load(self) -> WorkerLoad:
        return self.worker.load()

    def transfer_records(self) -> list[TransferRecord]:
        return self.worker.receiver.recorder.records

    def close(self) -> None:
        self.loop.stop()
        self.worker.stop_watching()
        self.worker.receiver.close()
        if self.worker.migration is not None:
            self.worker.migration.close()

    def _deliver_pull(self, pull: PullRequest) -> None:
        # Called on the step loop thread: hop to the actor's event loop to make the actor call.
        assert self._event_loop is not None, "add_prefill_peer() comes before any pull"
        asyncio.run_coroutine_threadsafe(self._carry_pull(pull), self._event_loop)

    def _release_source(self, handle: KVHandle, why: str) -> None:
        # Called on the step loop thread; fire and forget (if the source worker is gone, so are its blocks).
        actor = self._peer_actors.get(handle.source_worker_id)
        if actor is not None and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(actor.release_kv.remote, handle.transfer_id, why)

    async def _carry_pull(self, pull: PullRequest) -> None:
        # Nobody reads this coroutine's future: an error must end the pull here (refused: the prompt is
        # recomputed now), not vanish and leave the pull to wait for its deadline.
        try:
            reply = await self._peer_actors[pull.source_worker_id].accept_pull.remote(pull)
        except Exception as error:
            logger.warning("pull %s from %s could not be carried (%s); it is refused", pull.transfer_id,
                           pull.source_worker_id, type(error).__name__)
            reply = PullReply(pull.source_worker_id, pull.transfer_id, is_accepted=False,
                              reason=f"the pull request failed: {type(error).__name__}", send_seq=-1,
                              num_blocks=0)
        self.worker.on_pull_reply(reply)
        self.loop.wake()
