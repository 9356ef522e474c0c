"""The prefill worker as a Ray actor: an async front (submissions never wait behind a forward) over the
worker's step loop thread. Wrapped with ray.remote(...) by the pool, which sets its resources."""

from __future__ import annotations

import asyncio

from kv_transfer import PeerInfo, PullReply, PullRequest, TransferConfig, TransferRecord, make_sender
from llm_engine import EngineConfig, LLMEngine
from llm_engine.load import WorkerLoad
from llm_engine.step_loop import StepLoop
from llm_engine.worker_setup import TorchGroupSpec, setup_worker_process
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import TRANSFER_POLL_S, PrefillWorker

IDLE_POLL_S = 0.05  # with no KV offered the poller only checks now and then whether some is


class PrefillActor:
    def __init__(self, worker_id: str, engine_config: EngineConfig, backend: str,
                 transfer_config: TransferConfig, num_threads: int = 1,
                 torch_group: TorchGroupSpec | None = None) -> None:
        setup_worker_process(num_threads, torch_group)
        engine = LLMEngine(engine_config, scheduler_cls=PrefillScheduler)
        sender = make_sender(backend, worker_id, engine.runner.kv_cache, config=transfer_config)
        # The actor polls the sender from its event loop (_poll_transfers): the loop thread sleeps when idle.
        self.worker = PrefillWorker(worker_id, engine, sender, is_sender_polled_elsewhere=True)
        self.loop = StepLoop(f"prefill-{worker_id}", self.worker.step, num_threads, on_error=self.worker.fail)
        self.loop.start()
        self._transfer_poller: asyncio.Task[None] | None = None

    async def _poll_transfers(self) -> None:
        """Answer pulls from the actor's event loop while a forward runs on the loop thread (a NIXL claim
        would otherwise wait for the forward to end: up to a second for a long chunk on a CPU)."""
        while True:
            await asyncio.sleep(TRANSFER_POLL_S if self.worker.has_transfers else IDLE_POLL_S)
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
        """The worker's latest load; `failure` is set once its step loop has died."""
        return self.worker.load()

    def is_whole(self) -> bool:
        """No block held: for tests and drains."""
        return self.worker.engine.block_pool.is_whole()

    def transfer_records(self) -> list[TransferRecord]:
        return self.worker.sender.recorder.records

    def shutdown(self) -> None:
        if self._transfer_poller is not None:
            self._transfer_poller.cancel()
        self.loop.stop()
        self.worker.sender.close()
