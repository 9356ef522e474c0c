"""The decode role of a worker process (also the mixed role: a decode worker that is sent prompts without
a KV handle prefills them itself). Tokens stream back through the actor's Ray streaming generator; the
DecodeWorker's step loop runs on its own thread.

Lifecycle:  DecodeRole(engine) — the engine's scheduler becomes the decode scheduler (with the admission
    watermark), a KV receiver is built and registered over the engine's KV cache, the step loop starts
    → add_prefill_peer() / generate() / evacuate() → close(): the loop stops, the receiver deregisters.
    The engine (weights, KV cache) outlives the role: the worker actor (pool_worker) builds another role
    over it when the worker changes role.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from decode_pool.messages import DecodeOutput, DecodeRequest, coalesce
from decode_pool.worker import DecodeWorker
from kv_transfer import KVHandle, PeerInfo, PullRequest, TransferConfig, TransferRecord, make_receiver
from llm_engine import LLMEngine
from llm_engine.load import WorkerLoad
from llm_engine.scheduler import Scheduler
from llm_engine.step_loop import StepLoop


class DecodeRole:
    def __init__(self, worker_id: str, engine: LLMEngine, backend: str, transfer_config: TransferConfig,
                 watermark: float = 0.05, num_threads: int = 1) -> None:
        engine.use_scheduler(Scheduler, watermark)
        receiver = make_receiver(backend, worker_id, engine.runner.kv_cache, config=transfer_config)
        self.worker = DecodeWorker(worker_id, engine, receiver, deliver_pull=self._deliver_pull,
                                   release_source=self._release_source)
        self._prefill_actors: dict[str, Any] = {}  # prefill worker id → its actor handle
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self.loop = StepLoop(f"decode-{worker_id}", self.worker.step, num_threads, on_error=self.worker.fail)
        self.loop.start()

    async def add_prefill_peer(self, peer: PeerInfo, actor: Any = None) -> None:
        """Learn a prefill worker (once); `actor` is needed where the sender takes part in pulls."""
        self._event_loop = asyncio.get_running_loop()
        self._prefill_actors[peer.worker_id] = actor
        self.worker.add_peer(peer)
        self.loop.wake()

    def remove_prefill_peer(self, worker_id: str) -> None:
        """A prefill worker left the deployment: forget it."""
        self._prefill_actors.pop(worker_id, None)
        self.worker.remove_peer(worker_id)
        self.loop.wake()

    async def generate(self, request: DecodeRequest) -> AsyncIterator[DecodeOutput]:
        """Stream the request's tokens; closing or cancelling the stream aborts the request."""
        event_loop = asyncio.get_running_loop()
        queue: asyncio.Queue[DecodeOutput] = asyncio.Queue()

        def deliver(output: DecodeOutput) -> None:
            event_loop.call_soon_threadsafe(queue.put_nowait, output)

        self.worker.submit(request, deliver)
        self.loop.wake()
        is_finished = False
        try:
            while not is_finished:
                # Everything already queued goes out as one item: each Ray stream item has a fixed cost,
                # and a reader that fell behind should catch up, not fall further behind.
                outputs = [await queue.get()]
                while not queue.empty():
                    outputs.append(queue.get_nowait())
                output = coalesce(outputs)
                is_finished = output.finish_reason is not None
                yield output
        finally:
            if not is_finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self.loop.wake()

    def evacuate(self) -> None:
        """End every request here with finish_reason "migrate" (the gateway continues them elsewhere)."""
        self.worker.evacuate()
        self.loop.wake()

    def load(self) -> WorkerLoad:
        return self.worker.load()

    def transfer_records(self) -> list[TransferRecord]:
        return self.worker.receiver.recorder.records

    def close(self) -> None:
        self.loop.stop()
        self.worker.receiver.close()

    def _deliver_pull(self, pull: PullRequest) -> None:
        # Called on the step loop thread: hop to the actor's event loop to make the actor call.
        assert self._event_loop is not None, "add_prefill_peer() comes before any pull"
        asyncio.run_coroutine_threadsafe(self._carry_pull(pull), self._event_loop)

    def _release_source(self, handle: KVHandle, why: str) -> None:
        # Called on the step loop thread; fire and forget (if the prefill worker is gone, so are its blocks).
        actor = self._prefill_actors.get(handle.source_worker_id)
        if actor is not None and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(actor.release_kv.remote, handle.transfer_id, why)

    async def _carry_pull(self, pull: PullRequest) -> None:
        reply = await self._prefill_actors[pull.source_worker_id].accept_pull.remote(pull)
        self.worker.on_pull_reply(reply)
        self.loop.wake()
