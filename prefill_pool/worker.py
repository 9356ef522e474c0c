"""Prefill worker: prompts in, first tokens and KV handles out. Its step policy over the worker skeleton
(worker_runtime/step_worker.py: the inbox, the step loop, the load, the output channels).

Lifecycle of a request on this worker:
    submit() → INBOX → WAITING → RUNNING (chunks) → PREFILLED: first token sampled
      → OFFERED: KVHandle returned, blocks leased to the decode side
      → RELEASED (pulled, or lease expired) → blocks freed.
    A request whose first token ends it (EOS, stop token, max_tokens 1) is freed at once, with no handle.
    abort() works in every state; an OFFERED request's lease is withdrawn (unless a pull has claimed it).
    release_kv(transfer_id) ends an OFFERED request's lease at once when nobody will pull it (the decode
    side's pull failed or was aborted, or the client left): the lease itself is only the last resort.
    The leases are KVOffers' (worker_runtime/kv_offers.py), as a decode worker's handed-back streams are;
    their own thread polls the sender, so that a pull is answered while a forward runs.
    fail() (the step loop died) ends every request still here with finish_reason "error"; later submissions
    raise WorkerFailed.
Only the step loop's thread touches the engine; other threads go through the inbox.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from kv_transfer import BackendName, KVHandle, KVSender, TransferConfig, TransferRecord, make_sender
from llm_engine.batch import ModelInput
from llm_engine.choices import FirstToken
from llm_engine.engine import ForwardStep, LLMEngine
from llm_engine.finish_reason import FinishReason
from llm_engine.request import Request, RequestStatus
from prefill_pool.messages import PrefillRequest, PrefillResult, PrefillTimes
from prefill_pool.scheduler import PrefillScheduler
from worker_runtime.kv_offers import POLL_S, KVOffers
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.roles import Role
from worker_runtime.step_worker import StepWorker

logger = logging.getLogger(__name__)
ResultCallback = Callable[[PrefillResult], None]


@dataclasses.dataclass
class _Pending:
    request: PrefillRequest
    on_result: ResultCallback
    queued: float
    started: float = 0.0


class PrefillWorker(StepWorker[PrefillRequest, PrefillResult]):
    role = Role.PREFILL
    offers: KVOffers  # its prompts' (a prefill worker always offers)

    def __init__(self, worker_id: str, engine: LLMEngine, sender: KVSender,
                 outputs: OutputChannels | None = None, num_threads: int = 1) -> None:
        """The offers' sender is polled by the loop between forwards, and by a thread of its own once
        start()ed."""
        if not isinstance(engine.scheduler, PrefillScheduler):
            raise TypeError("a prefill worker's engine must use PrefillScheduler")
        self._pending: dict[str, _Pending] = {}
        super().__init__(worker_id, engine, KVOffers(sender, engine.kv, "prefill", engine.export_blocks),
                         outputs, num_threads)

    @classmethod
    def create(cls, worker_id: str, engine: LLMEngine, backend: BackendName, transfer_config: TransferConfig,
               outputs: OutputChannels, num_threads: int = 1) -> PrefillWorker:
        """The worker over `engine` (its scheduler becomes PrefillScheduler), its KV sender built and
        registered over the transfer cache (the engine's own, or a tensor-parallel worker's whole-head
        staging cache), started."""
        engine.use_scheduler(PrefillScheduler)
        sender = make_sender(backend, worker_id, engine.transfer_cache, config=transfer_config,
                             ranks=engine.rank_call)
        worker = cls(worker_id, engine, sender, outputs, num_threads)
        worker.start()
        return worker

    @property
    def sender(self) -> KVSender:
        return self.offers.sender

    def transfer_records(self) -> list[TransferRecord]:
        return self.sender.recorder.records

    def _num_queued_tokens(self, request: PrefillRequest) -> int:
        return len(request.prompt_token_ids)

    def _is_final(self, output: PrefillResult) -> bool:
        return True  # a prompt's result is its only output here

    def _fail_requests(self, error: BaseException,
                       arriving: list[tuple[PrefillRequest, ResultCallback, float]]) -> None:
        now = time.time()
        answers = [(p.request, p.on_result, p.queued) for p in self._pending.values()] + arriving
        self._pending.clear()
        for request, on_result, queued in answers:
            result = self._result(request.request_id, -1, None, FinishReason.ERROR, None, 0, queued, now)
            on_result(dataclasses.replace(result, error=f"prefill worker failed: {self.failure}"))

    def _after_forward(self, forward: ForwardStep) -> None:
        for request in forward.advanced:
            self._finish_prefill(request)

    def _idle_wait(self) -> float | None:
        # Nothing to compute (idle, or every waiting prompt needs blocks that leases hold): sleep until woken,
        # polling the sender while leases are out (unless a thread does), since their end frees blocks here.
        return POLL_S if self.offers.num_outstanding and not self.offers.is_polled else None

    def _before_forward(self, batch: ModelInput) -> None:
        now = time.time()
        for chunk in batch.chunks:
            pending = self._pending[chunk.request_id]
            pending.started = pending.started or now
        super()._before_forward(batch)

    def _snapshot(self) -> WorkerLoad:
        scheduler = self.engine.scheduler
        return WorkerLoad(
            worker_id=self.worker_id, role=Role.PREFILL, num_waiting=len(scheduler.waiting),
            num_queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens
                                         for r in scheduler.requests.values()),
            num_running=len(scheduler.running), num_transferring=self.offers.num_outstanding,
            num_free_blocks=self.engine.block_pool.num_free_blocks,
            num_total_blocks=self.engine.block_pool.num_blocks, num_outstanding_tokens=0,
            failure=self.failure, num_requests=len(self._pending) + self.offers.num_outstanding,
        )

    def _accept(self, request: PrefillRequest, on_result: ResultCallback, queued: float) -> None:
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
            self.offers.release_request(request_id, "the request was aborted")
            return
        self.engine.scheduler.abort(request_id)
        self.engine.kv.free(request_id)
        pending.on_result(self._result(request_id, -1, None, FinishReason.ABORT, None, 0, pending.queued,
                                       pending.started or time.time()))

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
            handle = self.offers.offer(request_id, request.num_computed_tokens)
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
