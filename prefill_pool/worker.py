"""Prefill worker: prompts in, first tokens and KV handles out.

Lifecycle of a request on this worker:
    submit() → INBOX → WAITING → RUNNING (chunks) → PREFILLED: first token sampled
      → OFFERED: KVHandle returned, blocks leased to the decode side
      → RELEASED (pulled, or lease expired) → blocks freed.
    A request whose first token ends it (EOS, stop token, max_tokens 1) is freed at once, with no handle.
    abort() works in every state; an OFFERED request's lease is withdrawn (unless a pull has claimed it).
    release(transfer_id) ends an OFFERED request's lease at once when nobody will pull it (the decode side's
    pull failed or was aborted, or the client left): the lease itself is only the last resort.
    fail() (the step loop died) ends every request still here with finish_reason "error"; later submissions
    raise WorkerFailed.
Only the step loop's thread touches the engine; submit(), abort() and release() go through a thread-safe
inbox. load() returns the snapshot the loop thread published after its last step.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from kv_transfer import KVHandle, KVSender, PullReply, PullRequest, ReleasedBlocks
from llm_engine.choices import FirstToken
from llm_engine.engine import LLMEngine
from llm_engine.finish_reason import FinishReason
from llm_engine.request import Request, RequestStatus
from prefill_pool.messages import PrefillRequest, PrefillResult, PrefillTimes
from prefill_pool.scheduler import PrefillScheduler
from worker_runtime.inbox import WorkerInbox
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)
ResultCallback = Callable[[PrefillResult], None]
# While leases are outstanding the loop polls the sender this often (seconds) even with no compute to do.
TRANSFER_POLL_S = 0.002


@dataclasses.dataclass
class _Pending:
    request: PrefillRequest
    on_result: ResultCallback
    queued: float
    started: float = 0.0


class PrefillWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, sender: KVSender,
                 is_sender_polled_elsewhere: bool = False) -> None:
        """Args:
        is_sender_polled_elsewhere: another thread calls poll_transfers() and wakes the loop when blocks
            come back (the actor does), so the idle loop need not poll the sender itself.
        """
        if not isinstance(engine.scheduler, PrefillScheduler):
            raise TypeError("a prefill worker's engine must use PrefillScheduler")
        self.worker_id = worker_id
        self.is_sender_polled_elsewhere = is_sender_polled_elsewhere
        self.engine = engine
        self.sender = sender
        # Commands from other threads, run by the loop thread at the start of its next step.
        self._inbox: WorkerInbox[tuple[PrefillRequest, ResultCallback, float]] = WorkerInbox(
            f"prefill worker {worker_id}")
        # The sender is polled by the loop thread and answers pull requests (torch) from the actor's thread.
        self._sender_lock = threading.Lock()
        self._released: list[ReleasedBlocks] = []  # seen by poll_transfers(), freed by the loop thread
        self._pending: dict[str, _Pending] = {}
        self._offered: dict[int, str] = {}  # transfer_id → request_id whose blocks it holds
        self._load = self._snapshot()

    # Called from any thread.
    def submit(self, request: PrefillRequest, on_result: ResultCallback) -> None:
        """Queue a prompt; raises ValueError at once if it can never be served here."""
        self.engine.check_request(request.prompt_token_ids, request.sampling)
        queued = time.time()
        self._inbox.submit(request.request_id, (request, on_result, queued),
                           lambda: self._start(request, on_result, queued), len(request.prompt_token_ids))

    def abort(self, request_id: str) -> None:
        self._inbox.post(lambda: self._abort(request_id))

    def release(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer: free its blocks now instead of when its lease ends."""
        self._inbox.post(lambda: self._release(transfer_id, why))

    @property
    def failure(self) -> str:
        """Why the step loop died; empty while it serves."""
        return self._inbox.failure

    def fail(self, error: BaseException) -> None:
        """The step loop died: answer every request still here with an error (called on the loop thread)."""
        arriving = self._inbox.fail(error)
        now = time.time()
        answers = [(p.request, p.on_result, p.queued) for p in self._pending.values()] + arriving
        self._pending.clear()
        for request, on_result, queued in answers:
            result = self._result(request.request_id, -1, None, FinishReason.ERROR, None, 0, queued, now)
            on_result(dataclasses.replace(result, error=f"prefill worker failed: {self.failure}"))
        self._load = dataclasses.replace(self._load, failure=self.failure)

    # The sender, from any thread (each call holds _sender_lock).
    def poll_transfers(self) -> bool:
        """Advance the sender (answer NIXL claims, see pulls finish) from any thread, so that a decode
        worker's pull does not wait for a forward to end; the blocks are freed by the loop thread.

        Returns:
            Whether some transfers were released (wake the loop to free their blocks).
        """
        with self._sender_lock:
            releases = self.sender.poll()
            self._released.extend(releases)
        return bool(releases)

    @property
    def has_transfers(self) -> bool:
        """Whether any offered KV waits for its pull (safe from any thread)."""
        return self.sender.num_outstanding > 0

    @property
    def expects_claims(self) -> bool:
        """Whether a receiver may still claim something here: KV is offered, or was withdrawn recently (its
        claim must be refused at once). Safe from any thread."""
        return self.sender.expects_claims

    # Called only from the step loop's thread (and accept_pull, load: from any thread, as marked).
    def step(self) -> float | None:
        """Run the inbox, release pulled/expired leases, run one forward; returns the wait before the next."""
        self._inbox.drain()
        with self._sender_lock:
            releases = self._released + self.sender.poll()
            self._released = []
        for released in releases:
            request_id = self._offered.pop(released.transfer_id, None)
            if request_id is not None:
                self.engine.kv.free(request_id)
        scheduler = self.engine.scheduler
        batch = scheduler.schedule() if scheduler.num_unfinished else None
        if batch is not None and batch.chunks:
            now = time.time()
            for chunk in batch.chunks:
                pending = self._pending[chunk.request_id]
                pending.started = pending.started or now
            self._load = self._snapshot()  # the requests just taken from the inbox, for the step's length
            output = self.engine.runner.execute(batch)
            for request in scheduler.update(batch, output):
                self._finish_prefill(request)
            self._load = self._snapshot()
            return 0.0
        self._load = self._snapshot()
        # Nothing to compute (idle, or every waiting prompt needs blocks that leases hold): sleep until woken,
        # polling the sender while leases are out, since their release is what frees blocks here.
        return TRANSFER_POLL_S if self._offered and not self.is_sender_polled_elsewhere else None

    def accept_pull(self, pull: PullRequest) -> PullReply:
        """For backends whose sender takes part (torch): post the send leg of a pull (any thread)."""
        with self._sender_lock:
            return self.sender.accept_pull(pull)

    def load(self) -> WorkerLoad:
        """The loop thread's latest snapshot, plus prompt tokens still in the inbox (any thread)."""
        load = self._load
        queued = load.num_queued_prompt_tokens + self._inbox.num_tokens
        return dataclasses.replace(load, num_queued_prompt_tokens=queued,
                                   num_requests=load.num_requests + self._inbox.num_arriving)

    def _snapshot(self) -> WorkerLoad:
        scheduler = self.engine.scheduler
        return WorkerLoad(
            worker_id=self.worker_id, role=Role.PREFILL, num_waiting=len(scheduler.waiting),
            num_queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens
                                         for r in scheduler.requests.values()),
            num_running=len(scheduler.running), num_transferring=len(self._offered),
            num_free_blocks=self.engine.block_pool.num_free_blocks,
            num_total_blocks=self.engine.block_pool.num_blocks, num_outstanding_tokens=0,
            failure=self.failure, num_requests=len(self._pending) + len(self._offered),
        )

    def _start(self, request: PrefillRequest, on_result: ResultCallback, queued: float) -> None:
        self._inbox.take(request.request_id)
        # The engine generates exactly one token here; the request's own max_tokens is judged in _finish.
        one_token = dataclasses.replace(request.sampling, max_tokens=1)
        try:
            self.engine.add_request(request.prompt_token_ids, one_token, request_id=request.request_id)
        except ValueError as error:
            logger.warning("prefill of %s refused: %s", request.request_id, error)
            on_result(self._result(request.request_id, -1, None, FinishReason.ABORT, None, 0, queued, queued))
            return
        self._pending[request.request_id] = _Pending(request, on_result, queued)

    def _abort(self, request_id: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is None:  # already finished; if its KV is still offered, nobody will pull it now
            for transfer_id, offered_id in list(self._offered.items()):
                if offered_id == request_id:
                    self._release(transfer_id, "the request was aborted")
            return
        self.engine.scheduler.abort(request_id)
        self.engine.kv.free(request_id)
        pending.on_result(self._result(request_id, -1, None, FinishReason.ABORT, None, 0, pending.queued,
                                       pending.started or time.time()))

    def _release(self, transfer_id: int, why: str) -> None:
        with self._sender_lock:
            released = self.sender.withdraw(transfer_id, why)
        request_id = self._offered.pop(transfer_id, None) if released is not None else None
        if request_id is not None:
            self.engine.kv.free(request_id)

    def _finish_prefill(self, request: Request) -> None:
        request_id = request.request_id
        pending = self._pending.pop(request_id)
        sampling = pending.request.sampling
        finish_reason: FinishReason | None = None
        if request.status is RequestStatus.FINISHED_STOPPED:
            finish_reason = FinishReason.STOP
        elif sampling.max_tokens == 1:
            finish_reason = FinishReason.LENGTH
        # n > 1: every choice's first token came from these logits; the KV is offered while any goes on.
        others = tuple(
            FirstToken(i, t.token_id, t.logprob, t.top_logprobs,
                       FinishReason.STOP if request.is_stop_token(t.token_id)
                       else FinishReason.LENGTH if sampling.max_tokens == 1 else None)
            for i, t in enumerate(request.other_first_tokens, start=1))
        handle = None
        if finish_reason is None or any(c.finish_reason is None for c in others):
            table = self.engine.kv.block_table(request_id)
            self.engine.export_blocks(table)  # a tensor-parallel worker's ranks' heads, gathered
            with self._sender_lock:
                handle = self.sender.offer(table, request.num_computed_tokens)
            self._offered[handle.transfer_id] = request_id
        else:
            self.engine.kv.free(request_id)
        logprob = request.output_logprobs[0] if request.output_logprobs else None
        result = self._result(request_id, request.output_token_ids[0], logprob, finish_reason, handle,
                              request.num_cached_tokens, pending.queued, pending.started)
        pending.on_result(dataclasses.replace(
            result, first_top_logprobs=request.output_top_logprobs[0] if request.output_top_logprobs else (),
            prompt_logprobs=request.scored_prompt(), other_choices=others))

    @staticmethod
    def _result(request_id: str, token: int, logprob: float | None, finish_reason: FinishReason | None,
                handle: KVHandle | None, cached: int, queued: float, started: float) -> PrefillResult:
        return PrefillResult(request_id, token, logprob, finish_reason, handle, cached,
                             PrefillTimes(queued, started, time.time()))
