"""The prefill role of a worker process: an async front (submissions never wait behind a forward) over a
PrefillWorker whose step loop runs on its own thread.

Lifecycle:  PrefillRole(engine) — the engine's scheduler becomes PrefillScheduler, a KV sender is built and
    registered over the engine's KV cache, the step loop starts → prefill() / release_kv() / accept_pull()
    → close(): the loop stops, the sender deregisters. The engine (weights, KV cache) outlives the role:
    the worker actor (pool_worker) builds another role over it when the worker changes role.
"""

from __future__ import annotations

import asyncio
import contextlib

from kv_transfer import PeerInfo, PullReply, PullRequest, TransferConfig, TransferRecord, make_sender
from llm_engine import LLMEngine
from llm_engine.load import WorkerLoad
from llm_engine.step_loop import StepLoop
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import TRANSFER_POLL_S, PrefillWorker

IDLE_POLL_S = 0.05  # with no KV offered, the poller waits this long for news that some is (a safety net)


class PrefillRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: str, transfer_config: TransferConfig,
                 num_threads: int = 1) -> None:
        engine.use_scheduler(PrefillScheduler)
        sender = make_sender(backend, worker_id, engine.runner.kv_cache, config=transfer_config)
        # The role polls the sender from the actor's event loop (_poll_transfers): the loop thread sleeps
        # when idle.
        self.worker = PrefillWorker(worker_id, engine, sender, is_sender_polled_elsewhere=True)
        self.loop = StepLoop(f"prefill-{worker_id}", self.worker.step, num_threads, on_error=self.worker.fail)
        self.loop.start()
        self._transfer_poller: asyncio.Task[None] | None = None
        # Set (on the event loop) as each result is delivered, its KV offered: the idle poller starts polling
        # at once, so the decode side's claim is answered within TRANSFER_POLL_S, not an idle sleep later.
        self._kv_offered = asyncio.Event()

    async def _poll_transfers(self) -> None:
        """Answer pulls from the actor's event loop while a forward runs on the loop thread (a NIXL claim
        would otherwise wait for the forward to end: up to a second for a long chunk on a CPU)."""
        while True:
            if self.worker.has_transfers:
                await asyncio.sleep(TRANSFER_POLL_S)
            else:
                self._kv_offered.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._kv_offered.wait(), IDLE_POLL_S)
            if self.worker.has_transfers and self.worker.poll_transfers():
                self.loop.wake()

    def peer_info(self) -> PeerInfo:
        return self.worker.sender.peer_info()

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Prefill one prompt; returns its first token and KV handle. Cancelling the call aborts it."""
        if self._transfer_poller is None:
            self._transfer_poller = asyncio.create_task(self._poll_transfers())
        event_loop = asyncio.get_running_loop()
        future: asyncio.Future[PrefillResult] = event_loop.create_future()

        def resolve(result: PrefillResult) -> None:
            if result.kv_handle is not None:
                self._kv_offered.set()
            if not future.done():  # the caller may have cancelled meanwhile
                future.set_result(result)

        def deliver(result: PrefillResult) -> None:
            event_loop.call_soon_threadsafe(resolve, result)

        self.worker.submit(request, deliver)  # ValueError reaches the caller
        self.loop.wake()
        try:
            return await future
        except asyncio.CancelledError:
            self.abort(request.request_id)
            raise

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self.loop.wake()

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer (its pull failed, or the request ended): free its blocks now."""
        self.worker.release(transfer_id, why)
        self.loop.wake()

    def accept_pull(self, pull: PullRequest) -> PullReply:
        reply = self.worker.accept_pull(pull)
        self.loop.wake()
        return reply

    def load(self) -> WorkerLoad:
        return self.worker.load()

    def transfer_records(self) -> list[TransferRecord]:
        return self.worker.sender.recorder.records

    def close(self) -> None:
        if self._transfer_poller is not None:
            self._transfer_poller.cancel()
        self.loop.stop()
        self.worker.sender.close()
