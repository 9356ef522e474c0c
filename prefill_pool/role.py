"""The prefill role of a worker process: an async front (submissions never wait behind a forward) over a
PrefillWorker whose step loop runs on its own thread. Results go back through the worker actor's
OutputChannels, like a decode worker's tokens: each step's results leave in one message per gateway, not one
actor reply per prompt.

Lifecycle:  PrefillRole(engine, outputs) — the engine's scheduler becomes PrefillScheduler, a KV sender is
    built and registered over the engine's KV cache, the step loop starts → submit() / abort() /
    release_kv() / accept_pull() → close(): the loop stops, the sender deregisters. The engine (weights, KV
    cache) outlives the role: the worker actor (pool_worker) builds another role over it when the worker
    changes role.
"""

from __future__ import annotations

import asyncio
import contextlib

from kv_transfer import (
    BackendName,
    PeerInfo,
    PullReply,
    PullRequest,
    TransferConfig,
    TransferRecord,
    make_sender,
)
from llm_engine.engine import LLMEngine
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import TRANSFER_POLL_S, PrefillWorker
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.step_loop import StepLoop

IDLE_POLL_S = 0.05  # with no KV offered, the poller waits this long for news that some is (a safety net)


class PrefillRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: BackendName,
                 transfer_config: TransferConfig, outputs: OutputChannels, num_threads: int = 1) -> None:
        engine.use_scheduler(PrefillScheduler)
        # The transfer cache: the engine's own, or a tensor-parallel worker's whole-head staging cache.
        sender = make_sender(backend, worker_id, engine.transfer_cache, config=transfer_config,
                             ranks=engine.rank_call)
        # The role polls the sender from the actor's event loop (_poll_transfers): the loop thread sleeps
        # when idle.
        self.worker = PrefillWorker(worker_id, engine, sender, is_sender_polled_elsewhere=True)
        self.outputs = outputs
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._transfer_poller: asyncio.Task[None] | None = None
        # Set as a step's results, their KV offered, are handed out: the idle poller starts polling at once,
        # so the decode side's claim is answered within TRANSFER_POLL_S, not an idle sleep later.
        self._kv_offered = asyncio.Event()
        self._has_offered = False  # this step handed out a result with KV (loop thread only)
        self.loop = StepLoop(f"prefill-{worker_id}", self._step, num_threads, on_error=self._fail)
        self.loop.start()

    def submit(self, request: PrefillRequest, channel_id: str) -> None:
        """Start prefilling the prompt; its PrefillResult goes to the output channel `channel_id`. Raises
        ValueError (it can never be served here) or WorkerFailed (the step loop died)."""
        self._event_loop = asyncio.get_running_loop()
        if self._transfer_poller is None:
            self._transfer_poller = asyncio.create_task(self._poll_transfers())
        self.outputs.subscribe(request.request_id, channel_id)
        try:
            self.worker.submit(request, self._collect)
        except BaseException:
            self.outputs.unsubscribe(request.request_id)
            raise
        self.loop.wake()

    # The loop thread: results are collected during a step and leave together at its end.
    def _collect(self, result: PrefillResult) -> None:
        self._has_offered = self._has_offered or result.kv_handle is not None
        self.outputs.collect(result)

    def _step(self) -> float | None:
        wait = self.worker.step()
        self._flush()
        return wait

    def _fail(self, error: BaseException) -> None:
        self.worker.fail(error)
        self._flush()

    def _flush(self) -> None:
        self.outputs.flush()
        if self._has_offered and self._event_loop is not None:
            self._has_offered = False
            self._event_loop.call_soon_threadsafe(self._kv_offered.set)

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
            # Also polled with nothing offered while a claim for withdrawn KV may still come: its puller
            # must hear the refusal now, not at the pull's deadline.
            if self.worker.expects_claims and self.worker.poll_transfers():
                self.loop.wake()

    def peer_info(self) -> PeerInfo:
        return self.worker.sender.peer_info()

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
