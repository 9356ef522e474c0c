"""The decode role of a worker process (also the mixed role: a decode worker that is sent prompts without
a KV handle prefills them itself). Tokens go back through the worker actor's OutputChannels: each step's
outputs leave in one message per gateway, not one per request; the DecodeWorker's step loop runs on its own
thread.

Lifecycle:  DecodeRole(engine, outputs) — the engine's scheduler becomes the decode scheduler (with the
    admission watermark), a KV receiver is built and registered over the engine's KV cache (and, where the
    backend allows, a KV sender too, to offer evacuated streams' KV: worker_runtime/kv_offers.py), the step
    loop starts → add_peer() / submit() / abort() / evacuate() / release_kv() → close(): the loop stops, the
    receiver and sender deregister.
    Peers are the workers this one may pull KV from: every prefill worker, and every other decode or mixed
    worker where migration is possible.
    The engine (weights, KV cache) outlives the role: the worker actor (pool_worker) builds another role
    over it when the worker changes role.
"""

from __future__ import annotations

import asyncio

from decode_pool.messages import DecodeRequest
from decode_pool.worker import DecodeWorker
from kv_transfer import (
    BackendName,
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
from llm_engine.engine import LLMEngine
from llm_engine.scheduler import Scheduler
from worker_runtime.kv_offers import KVOffers
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.peer_client import PeerClient
from worker_runtime.step_loop import StepLoop


class DecodeRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: BackendName,
                 transfer_config: TransferConfig, outputs: OutputChannels, watermark: float,
                 num_threads: int = 1) -> None:
        """Args:
        watermark: the share of blocks kept free when admitting pulls (its default lives in the fleet's
            config, gateway/fleet/config.py).
        """
        engine.use_scheduler(Scheduler, watermark)
        # The transfer cache: the engine's own, or a tensor-parallel worker's whole-head staging cache; or,
        # where the backend reads each rank's heads where they live, rank 0's own and the other ranks'.
        receiver = make_receiver(backend, worker_id, engine.transfer_cache, config=transfer_config,
                                 ranks=engine.rank_call)
        migration = None
        if can_move_kv_between_decode_workers(backend):
            sender = make_sender(backend, worker_id, engine.transfer_cache, config=transfer_config,
                                 ranks=engine.rank_call)
            migration = KVOffers(sender, engine.kv, "migration", engine.export_blocks)
        self.outputs = outputs
        self.worker = DecodeWorker(worker_id, engine, receiver, deliver_pull=self._deliver_pull,
                                   release_source=self._release_source, on_step_end=outputs.flush,
                                   wake=lambda: self.loop.wake(), migration=migration)
        self._peers: dict[str, PeerClient | None] = {}  # id of a worker this one pulls from → its client
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.loop = StepLoop(f"decode-{worker_id}", self.worker.step, num_threads, on_error=self.worker.fail)
        self.loop.start()
        self.worker.start_watching()

    async def add_peer(self, peer: PeerInfo, client: PeerClient | None = None) -> None:
        """Learn a worker to pull from (once); `client` tells it about handles nobody will pull, and carries
        pulls where the sender takes part (None: tests that wire in-process peers)."""
        self._event_loop = asyncio.get_running_loop()
        self._peers[peer.worker_id] = client
        self.worker.add_peer(peer)
        self.loop.wake()

    def remove_peer(self, worker_id: str) -> None:
        """A worker left its role or the deployment: forget its endpoint."""
        self._peers.pop(worker_id, None)
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
        assert self._event_loop is not None, "add_peer() comes before any pull"
        asyncio.run_coroutine_threadsafe(self._carry_pull(pull), self._event_loop)

    def _release_source(self, handle: KVHandle, why: str) -> None:
        # Called on the step loop thread; fire and forget (if the source worker is gone, so are its blocks).
        client = self._peers.get(handle.source_worker_id)
        if client is not None and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(client.release_kv, handle.transfer_id, why)

    async def _carry_pull(self, pull: PullRequest) -> None:
        # Nobody reads this coroutine's future: the client turns a failed call into a refused reply (the
        # prompt is recomputed now) rather than leaving the pull to wait for its deadline.
        client = self._peers.get(pull.source_worker_id)
        if client is None:
            reply = PullReply(pull.source_worker_id, pull.transfer_id, is_accepted=False,
                              reason="no client for the peer", send_seq=-1, num_blocks=0)
        else:
            reply = await client.accept_pull(pull)
        self.worker.on_pull_reply(reply)
        self.loop.wake()
