"""The prefill role of a worker process: an async front (submissions never wait behind a forward) over a
PrefillWorker whose step loop runs on its own thread. Results go back through the worker actor's
OutputChannels, like a decode worker's tokens: each step's results leave in one message per gateway, not one
actor reply per prompt.

Lifecycle:  PrefillRole(engine, outputs) — the engine's scheduler becomes PrefillScheduler, a KV sender is
    built and registered over the engine's KV cache, the step loop starts, and the offers' own thread polls
    the sender while KV is offered (a pull is answered while a forward runs: worker_runtime/kv_offers.py)
    → submit() / abort() / release_kv() / accept_pull() → close(): the loop stops, the sender deregisters.
    The engine (weights, KV cache) outlives the role: the worker actor (pool_worker) builds another role over
    it when the worker changes role.
"""

from __future__ import annotations

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
from prefill_pool.messages import PrefillRequest
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import PrefillWorker
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.step_loop import StepLoop


class PrefillRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: BackendName,
                 transfer_config: TransferConfig, outputs: OutputChannels, num_threads: int = 1) -> None:
        engine.use_scheduler(PrefillScheduler)
        # The transfer cache: the engine's own, or a tensor-parallel worker's whole-head staging cache.
        sender = make_sender(backend, worker_id, engine.transfer_cache, config=transfer_config,
                             ranks=engine.rank_call)
        self.worker = PrefillWorker(worker_id, engine, sender)
        self.outputs = outputs
        self.loop = StepLoop(f"prefill-{worker_id}", self._step, num_threads, on_error=self._fail)
        self.loop.start()
        self.worker.offers.start_polling(self.loop.wake)

    def submit(self, request: PrefillRequest, channel_id: str) -> None:
        """Start prefilling the prompt; its PrefillResult goes to the output channel `channel_id`. Raises
        ValueError (it can never be served here) or WorkerFailed (the step loop died)."""
        self.outputs.subscribe(request.request_id, channel_id)
        try:
            self.worker.submit(request, self.outputs.collect)
        except BaseException:
            self.outputs.unsubscribe(request.request_id)
            raise
        self.loop.wake()

    # The loop thread: results are collected during a step and leave together at its end.
    def _step(self) -> float | None:
        try:
            return self.worker.step()
        finally:
            self.outputs.flush()

    def _fail(self, error: BaseException) -> None:
        self.worker.fail(error)
        self.outputs.flush()

    def peer_info(self) -> PeerInfo:
        return self.worker.offers.peer_info()

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
        self.loop.stop()
        self.worker.offers.close()
