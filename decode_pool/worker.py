"""(Over 300 lines: the step policy and the request's ends (emit, abort, finish, fail) share one entry table;
its queues, engine admission and evacuation are split out.)

Decode worker: requests with a KV handle in, tokens out; its step policy over the worker skeleton
(worker_runtime/step_worker.py: the inbox, the step loop, the load, the output channels). Also the mixed
role: a request sent without a KV handle is prefilled here.

Lifecycle of a request on this worker, one line per queue:
    1. INBOX            submit() from any thread; taken by the loop at its next step
    2. AWAITING_BLOCKS  (pull_queue.py) until blocks for the prompt + the watermark reserve are free
    3. TRANSFERRING     (pull_queue.py) blocks allocated, pull started; polled, never awaited
    4. RUNNING          (engine_admission.py) in the engine's batch from the next step (or WAITING: prefill)
    5. FINISHED         finish_reason "stop" or "length" (the engine), "abort", "error" (fail()) or
                        "migrate" (handed back: evacuation.py); its blocks freed, or offered (KVOffers)
    A request without a handle (the mixed role, or one migrated from a failed worker with the tokens it
    already generated) is prefilled here: the engine's WAITING queue. One moved from a worker that evacuated
    it comes with the tokens so far and a handle to their KV: it is pulled like a prefill worker's.
    A FAILED pull is not fatal: the blocks are freed and the prompt recomputed here.
    A request with several choices (DecodeRequest.choices) is one group until its pull ends, then one request
    per choice forked from the pulled blocks (decode_pool/choice_groups.py).
    Preemption (blocks ran short) is the engine's: recompute, tokens kept, nothing lost.
    abort() works in every state; an aborted TRANSFERRING request's pull is cancelled where it can be, and its
    blocks are freed when the pull ends (at the next step when cancelled).
    Whenever a handle will not be pulled (aborted before its pull, pull FAILED), release_source() tells the
    prefill side at once, so its blocks do not wait for the lease to end.
    fail() (the step loop died) ends every request here with finish_reason "error" (those in the batch of the
    step that raised marked in_failed_step, unless the worker's own fault broke it:
    llm_engine/step_faults.py); later submissions raise WorkerFailed, and the gateway migrates the streams to
    another decode worker.
Peers are the workers this one pulls KV from (every prefill worker, and every other decode or mixed worker
where migration is possible): add_peer() learns one with its PeerClient, through which the worker itself
carries pull requests and releases on the actor's event loop (captured at submit_to()).
Only the step loop's thread touches the engine; the receiver is shared with the PullWatcher's thread under
its lock; other threads use the inbox.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from decode_pool.choice_groups import ChoiceGroups
from decode_pool.engine_admission import EngineAdmission
from decode_pool.entry import DecodeEntry, OutputCallback
from decode_pool.evacuation import Evacuated, Evacuation
from decode_pool.messages import DecodeOutput, DecodeRequest, DecodeTimes
from decode_pool.pull_queue import PullEnd, PullQueue
from kv_transfer import (
    BackendName,
    KVHandle,
    KVReceiver,
    PeerInfo,
    PullReply,
    PullRequest,
    TransferConfig,
    TransferRecord,
    TransferState,
    can_move_kv_between_decode_workers,
    make_receiver,
    make_sender,
)
from llm_engine.batch import ModelInput
from llm_engine.engine import ForwardStep, LLMEngine
from llm_engine.finish_reason import FinishReason
from llm_engine.request import Request
from llm_engine.scheduler import Scheduler
from llm_engine.step_faults import is_worker_fault
from worker_runtime.kv_offers import KVOffers
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.peer_client import PeerClient
from worker_runtime.prefill_slicer import PrefillSlicer
from worker_runtime.roles import Role
from worker_runtime.step_worker import StepWorker

logger = logging.getLogger(__name__)
TRANSFER_POLL_S = 0.001  # the idle loop's poll while pulls run, when no PullWatcher thread wakes it
# At a step's start, a pull just started is waited for at most this long, and at most this share of the
# last step: the request it carries then joins this step, at that small cost to the others in it.
MAX_JOIN_WAIT_S = 0.015
JOIN_WAIT_SHARE = 0.2
WITHDRAWN_CLAIM_POLL_S = 0.05  # the idle loop's poll while only claims for withdrawn KV may still come


class DecodeWorker(StepWorker[DecodeRequest, DecodeOutput]):
    role = Role.DECODE

    def __init__(self, worker_id: str, engine: LLMEngine, receiver: KVReceiver,
                 migration: KVOffers | None = None, outputs: OutputChannels | None = None,
                 num_threads: int = 1) -> None:
        """Args:
        migration: offers evacuated streams' KV to the worker that continues them (the skeleton's offers);
            None: they are recomputed there.
        """
        self.receiver = receiver
        self._peers: dict[str, PeerClient | None] = {}  # id of a worker this one pulls from → its client
        self._pulls = PullQueue(engine, receiver, self.wake, self._deliver_pull, f"pulls-{worker_id}")
        self._entries: dict[str, DecodeEntry] = {}
        self._groups = ChoiceGroups()  # requests with several choices, until their pull ends
        self._admission = EngineAdmission(engine, self._entries, self._groups)
        self._evacuation = Evacuation(engine, self._entries, self._pulls, self._groups, migration)
        self._in_step: tuple[str, ...] = ()  # the requests of the forward under way (suspects if it raises)
        config = engine.config
        self._slicer = PrefillSlicer(config.max_prefill_s_beside_decode, config.max_num_batched_tokens)
        self._last_step_s = 0.0  # the last forward's duration (bounds the wait for a pull at a step's start)
        super().__init__(worker_id, engine, migration, outputs, num_threads)

    @classmethod
    def create(cls, worker_id: str, engine: LLMEngine, backend: BackendName, transfer_config: TransferConfig,
               outputs: OutputChannels, watermark: float, num_threads: int = 1) -> DecodeWorker:
        """The worker over `engine` (its scheduler becomes the decode scheduler, with the admission
        `watermark`: its default lives in gateway/fleet/config.py), its KV receiver built and registered over
        the transfer cache (and, where the backend can move KV between decode workers, a sender to offer
        evacuated streams' KV), started."""
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
        worker = cls(worker_id, engine, receiver, migration, outputs, num_threads)
        worker.start()
        return worker

    def start(self) -> None:
        """The step loop, the migration sender's poller, and the PullWatcher's thread (it wakes the loop when
        a pull ends); a worker never started polls its pulls at each step."""
        super().start()
        self._pulls.start_watching()

    def close(self) -> None:
        super().close()
        self._pulls.stop_watching()
        self.receiver.close()

    def transfer_records(self) -> list[TransferRecord]:
        return self.receiver.recorder.records

    # Called from any thread.
    def _output_ids(self, request: DecodeRequest) -> tuple[str, ...]:
        return request.output_request_ids

    def _is_final(self, output: DecodeOutput) -> bool:
        return output.finish_reason is not None

    def evacuate(self) -> None:
        """End every request here with finish_reason "migrate", freeing its blocks (see the lifecycle)."""
        self._post(lambda: self._hand_back(self._evacuation.evacuate()))

    def move_out(self, request_ids: list[str]) -> None:
        """Hand these requests back (finish_reason "migrate"), as evacuate() does, for the gateway to continue
        on another worker: a running stream with its KV offered, a prompt not started yet as it came (the
        gateway routes it again). One mid-prefill, or whose KV cannot be offered (no migration sender),
        stays here."""
        self._post(lambda: self._hand_back(self._evacuation.move_out(request_ids)))

    def add_peer(self, peer: PeerInfo, client: PeerClient | None = None) -> None:
        """Learn a sender, and `client`, through which this worker tells it about handles nobody will pull
        and carries pulls where the sender takes part (None: tests that wire in-process peers). A peer this
        worker can never pull from (another layout, another backend) is refused here, in the caller (the
        fleet's wiring fails, not this worker); an error of the transfer library while adding it is logged
        on the step thread and the peer stays unknown (pulls from it are refused and recomputed): neither
        kills the step loop.

        Raises:
            IncompatibleLayoutError, ValueError: as KVReceiver.check_peer.
        """
        self.receiver.check_peer(peer)
        self._peers[peer.worker_id] = client
        self._post(lambda: self._peer_command(f"adding peer {peer.worker_id}",
                                              lambda: self.receiver.add_peer(peer)))

    def remove_peer(self, worker_id: str) -> None:
        """A worker left its role or the deployment: forget its endpoint."""
        self._peers.pop(worker_id, None)
        self._post(lambda: self._peer_command(f"removing peer {worker_id}",
                                              lambda: self.receiver.remove_peer(worker_id)))

    def _peer_command(self, what: str, call: Callable[[], None]) -> None:
        try:
            self._pulls.with_receiver(call)
        except Exception:  # one peer's trouble, not this worker's: its streams go on
            logger.exception("%s failed; the worker serves on without it", what)

    def on_pull_reply(self, reply: PullReply) -> None:
        self._post(lambda: self._pulls.with_receiver(lambda: self.receiver.on_pull_reply(reply)))

    def release_source(self, handle: KVHandle, why: str) -> None:
        """Tell a handle's sender that nobody will pull it, so that it frees the blocks now (loop thread; fire
        and forget: if the sender is gone, so are its blocks)."""
        client = self._peers.get(handle.source_worker_id)
        if client is not None and self._event_loop is not None:
            self._event_loop.call_soon_threadsafe(client.release_kv, handle.transfer_id, why)

    def _deliver_pull(self, pull: PullRequest) -> None:
        # On the watcher's or the loop's thread: hop to the actor's event loop to make the actor call.
        assert self._event_loop is not None, "a pull comes after its request's submit_to()"
        asyncio.run_coroutine_threadsafe(self._carry_pull(pull), self._event_loop)

    async def _carry_pull(self, pull: PullRequest) -> None:
        # Nobody reads this coroutine's future: the client turns a failed call into a refused reply (the
        # prompt is recomputed now) rather than leaving the pull to wait for its deadline.
        client = self._peers.get(pull.source_worker_id)
        if client is None:
            reply = PullReply(pull.source_worker_id, pull.transfer_id, is_accepted=False,
                              reason="no client for the peer", send_seq=-1, num_blocks=0)
        else:
            reply = await client.accept_pull(pull)
        self.on_pull_reply(reply)

    # Called only from the step loop's thread.
    def _fail_requests(self, error: BaseException,
                       arriving: list[tuple[DecodeRequest, OutputCallback, float]]) -> None:
        now = time.time()
        message = f"decode worker failed: {self.failure}"
        for request, on_output, _ in arriving:
            self._release_unpulled(request, "the decode worker failed")
            on_output(DecodeOutput(request.request_id, (), (), now, finish_reason=FinishReason.ERROR,
                                   error=message))
        # The batch of the step that raised is suspect, unless the worker's own fault broke it.
        suspects = set() if is_worker_fault(error) else set(self._in_step)
        failed_step_id = f"{self.worker_id}@{now:.6f}"
        for request_id, entry in list(self._entries.items()):
            if entry.transfer_finished is None:
                self._release_unpulled(entry.request, "the decode worker failed")
            is_suspect = request_id in suspects
            self._finish(request_id, FinishReason.ERROR, now, DecodeOutput(
                request_id, (), (), now, finish_reason=FinishReason.ERROR, error=message,
                in_failed_step=is_suspect, failed_step_id=failed_step_id if is_suspect else "",
                num_in_failed_step=len(suspects) if is_suspect else 0))

    def _before_step(self) -> None:
        """Admission → transfers: pulls started while blocks allow, ended pulls admitted to the engine."""
        num_started = self._pulls.admit(self._on_pull_refused)
        if num_started and self._pulls.is_watching and self.engine.scheduler.running:
            # A pull takes milliseconds: wait for it (briefly) so that the request joins this step rather
            # than the next; a moved stream would otherwise miss one more of this worker's steps.
            self._pulls.wait_finished(min(MAX_JOIN_WAIT_S, JOIN_WAIT_SHARE * self._last_step_s))
        for ended in self._pulls.take_ended():
            self._on_pull_end(ended)
        self.engine.scheduler.prefill_budget_beside_decode = self._slicer.budget()

    def _after_forward(self, forward: ForwardStep) -> None:
        step = forward.record
        if step is not None:
            self._last_step_s = step.duration_ms / 1000
            self._slicer.observe(step.duration_ms / 1000, step.num_prefill_tokens, step.num_decode_tokens)
        for request in forward.advanced:
            self._emit(request, forward.finished_at)
        self._in_step = ()

    def _idle_wait(self) -> float | None:
        # Nothing to compute (idle, or every waiting request needs blocks): sleep until woken (a submission,
        # an abort, the end of a pull), since a pull's end is what frees or fills blocks; without a watcher
        # thread, poll the receiver while pulls run.
        # The migration sender answers pulls from this loop: poll it while its leases are out.
        is_polling = (self._pulls.num_transferring and not self._pulls.is_watching) or self._num_offered
        if is_polling:
            return TRANSFER_POLL_S
        # A claim for withdrawn migration KV may still come: refuse it soon, whoever waits for it.
        is_claimable = self.offers is not None and self.offers.expects_claims
        return WITHDRAWN_CLAIM_POLL_S if is_claimable else None

    def _before_forward(self, batch: ModelInput) -> None:
        super()._before_forward(batch)
        self._in_step = tuple(chunk.request_id for chunk in batch.chunks)  # suspects if the forward raises

    @property
    def _num_offered(self) -> int:
        return self.offers.num_outstanding if self.offers is not None else 0

    def _snapshot(self) -> WorkerLoad:
        scheduler = self.engine.scheduler
        return WorkerLoad(
            worker_id=self.worker_id, role=Role.DECODE,
            num_waiting=self._pulls.num_awaiting_blocks + len(scheduler.waiting),
            num_queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            num_running=len(scheduler.running), num_transferring=self._pulls.num_transferring,
            num_free_blocks=self.engine.block_pool.num_free_blocks,
            num_total_blocks=self.engine.block_pool.num_blocks,
            num_outstanding_tokens=sum(e.request.sampling.max_tokens * self._groups.num_choices(r)
                                       for r, e in self._entries.items()),
            failure=self.failure, num_requests=len(self._entries) + self._num_offered,
        )

    def _accept(self, request: DecodeRequest, on_output: OutputCallback, queued: float) -> None:
        self._inbox.take(request.request_id)
        self._entries[request.request_id] = DecodeEntry(request, on_output, queued)
        if request.choices:
            self._groups.add(request)
        handle = request.kv_handle
        if handle is not None and request.generated_token_ids and (
                handle.num_tokens != len(request.prompt_token_ids) + len(request.generated_token_ids) - 1):
            # A moved stream's KV must cover everything but its last token; anything else is recomputed.
            logger.warning("migrated KV of %s covers %d tokens, not prompt + tokens so far - 1; recomputing",
                           request.request_id, handle.num_tokens)
            self._release_unpulled(request, "the KV does not match the tokens so far")
            self._admission.start_local(request.request_id)
        elif handle is None:
            if request.choices:  # the gateway sends groups with a handle only; recompute each choice
                self._admission.split(request.request_id, is_pulled=False)
            else:
                self._admission.start_local(request.request_id)
        else:
            self._pulls.add(self._entries[request.request_id])

    def _on_pull_refused(self, request_id: str, why: str) -> None:
        self._on_pull_end(PullEnd(request_id, TransferState.FAILED, why, time.time()))

    def _on_pull_end(self, ended: PullEnd) -> None:
        """A pull ended: the request joins the running batch (DONE) or is recomputed here (FAILED)."""
        request_id, state, reason = ended.request_id, ended.state, ended.reason
        entry = self._entries[request_id]
        entry.transfer_finished = ended.finished_at
        if state is not TransferState.DONE:
            self._release_unpulled(entry.request, "aborted during the pull" if entry.is_aborted else reason)
        if entry.is_aborted:
            self.engine.kv.free(request_id)
            self._finish(request_id, entry.abort_reason, entry.transfer_finished)
            return
        if state is TransferState.DONE and self.engine.stages_kv:  # each rank takes its heads
            self.engine.import_blocks(self.engine.kv.block_table(request_id))
        if entry.request.choices:
            self._admission.split(request_id, is_pulled=state is TransferState.DONE)
        else:
            self._admission.start_pulled(request_id, is_pulled=state is TransferState.DONE, reason=reason)

    def _release_unpulled(self, request: DecodeRequest, why: str) -> None:
        if request.kv_handle is not None:
            self.release_source(request.kv_handle, why)

    def _emit(self, request: Request, now: float) -> None:
        entry = self._entries[request.request_id]
        entry.admitted = entry.admitted or now
        logprobs = tuple(request.output_logprobs[-1:]) if request.sampling.logprobs else ()
        is_first = request.num_output_tokens == 1  # prefilled here: the prompt's logprobs go with it
        output = DecodeOutput(request.request_id, (request.output_token_ids[-1],), logprobs, now, (now,),
                              top_logprobs=tuple(request.output_top_logprobs[-1:]) if logprobs else (),
                              prompt_logprobs=request.scored_prompt() if is_first else None)
        if request.is_finished:
            output = dataclasses.replace(output, finish_reason=request.status.finish_reason,
                                         num_preemptions=request.num_preemptions,
                                         num_cached_tokens=request.num_cached_tokens)
            self._finish(request.request_id, request.status.finish_reason, now, output)
        else:
            entry.on_output(output)

    def _abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        group_id = self._groups.group_of(request_id)
        if group_id is not None:  # one choice of a group still pulling: it ends alone, unless it was the last
            group = self._entries[group_id]
            now = time.time()
            is_last = self._groups.drop(request_id)
            group.on_output(DecodeOutput(request_id, (), (), now, finish_reason=reason, times=DecodeTimes(
                group.queued, group.transfer_started, group.transfer_finished, None, now)))
            if is_last:
                self._abort(group_id, reason)
            return
        entry = self._entries.get(request_id)
        if entry is None:
            return
        entry.abort_reason = reason
        if self._pulls.withdraw(request_id):
            self._release_unpulled(entry.request, "aborted before its pull")
        elif self._pulls.is_transferring(request_id):
            # The pull may still write into the blocks: free them when it ends, now if it can be stopped
            # (before its READ, or a READ NIXL cancels), else at its end or deadline.
            entry.is_aborted = True
            assert entry.request.kv_handle is not None
            self._pulls.cancel(entry.request.kv_handle, "the request was aborted")
            return
        else:
            self.engine.scheduler.abort(request_id)
        self._finish(request_id, reason, time.time())

    def _hand_back(self, evacuated: Evacuated) -> None:
        """End what the evacuation handed back with finish_reason "migrate": with its KV handle (offered
        here, or its pull's, unused), or aborted (recomputed where it goes)."""
        now = time.time()
        migrate = FinishReason.MIGRATE
        for request_id, handle in evacuated.handed_back:
            self._finish(request_id, migrate, now,
                         DecodeOutput(request_id, (), (), now, finish_reason=migrate, kv_handle=handle))
        for request_id in evacuated.aborted:
            self._abort(request_id, migrate)

    def _finish(self, request_id: str, reason: FinishReason, now: float, output: DecodeOutput | None = None,
                error: str = "") -> None:
        entry = self._entries.pop(request_id)
        times = DecodeTimes(entry.queued, entry.transfer_started, entry.transfer_finished, entry.admitted,
                            now)
        output = output or DecodeOutput(request_id, (), (), now, finish_reason=reason, error=error)
        output = dataclasses.replace(output, times=times, transfer_bytes=entry.transfer_bytes)
        if self._groups.is_group(request_id):  # ended before its split: so does each remaining choice
            for choice_output in self._groups.fan_out(request_id, output):
                entry.on_output(choice_output)
            return
        entry.on_output(output)
