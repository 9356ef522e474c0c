"""Decode worker: requests with a KV handle in, tokens out, one step at a time.

Lifecycle of a request on this worker:
    submit() → INBOX → AWAITING_BLOCKS (admission: prompt blocks + the watermark reserve must be free)
      → TRANSFERRING (blocks allocated, pull started; polled by the PullWatcher's thread as it runs and at
        every step, never awaited: its end is stamped when seen and wakes the loop)
      → RUNNING (joins the engine's running batch at the next step: iteration-level batching)
      → FINISHED (stop, length, abort); blocks freed.
    A request without a handle is prefilled here (colocated mode, or a request migrated from a failed worker
    with the tokens it already generated) and joins the engine's WAITING queue. A request moved from a
    worker that evacuated it comes with the tokens so far and a handle to their KV: it is pulled like a
    prefill worker's (and recomputed here if that fails).
    A FAILED pull is not fatal: the blocks are freed and the prompt recomputed here.
    A request with several choices (DecodeRequest.choices) is one group until its pull ends, then one request
    per choice forked from the pulled blocks (decode_pool/choice_groups.py).
    Preemption (blocks ran short) is the engine's: recompute, tokens kept, nothing lost.
    abort() works in every state; an aborted TRANSFERRING request's pull is cancelled where it can be, and its
    blocks are freed when the pull ends (at the next step when cancelled).
    evacuate() ends every request here as abort() does, but with finish_reason "migrate": the gateway
    continues each on another worker from the tokens the client has (a worker changing role leaves now).
    A request still AWAITING_BLOCKS goes back with its handle unused, so the next worker pulls its KV.
    With a migration sender, a RUNNING stream's blocks are kept and offered instead (decode_pool.migration):
    its last output carries the KVHandle, the next worker pulls it, and the blocks are freed when its lease
    ends; the worker holds work (num_requests) until then.
    Whenever a handle will not be pulled (aborted before its pull, pull FAILED), release_source() tells the
    prefill side at once, so its blocks do not wait for the lease to end.
    fail() (the step loop died) ends every request here with finish_reason "error" (those in the batch of the
    step that raised marked in_failed_step); later submissions raise WorkerFailed, and the gateway migrates
    the streams to another decode worker.
Only the step loop's thread touches the engine; the receiver is shared with the PullWatcher's thread under
its lock; other threads use the inbox, and load() returns the snapshot the loop thread published after its
last step.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable

from decode_pool.choice_groups import ChoiceGroups
from decode_pool.messages import DecodeOutput, DecodeRequest, DecodeTimes
from decode_pool.migration import MigrationOffers
from decode_pool.pull_watcher import PullWatcher
from kv_transfer import KVHandle, KVReceiver, PeerInfo, PullReply, PullRequest, TransferState
from llm_engine import LLMEngine
from llm_engine.kv_cache_manager import blocks_for
from llm_engine.request import Request
from worker_runtime.inbox import WorkerInbox
from worker_runtime.load import WorkerLoad
from worker_runtime.prefill_slicer import PrefillSlicer

logger = logging.getLogger(__name__)
OutputCallback = Callable[[DecodeOutput], None]
TRANSFER_POLL_S = 0.001  # the idle loop's poll while pulls run, when no PullWatcher thread wakes it
# At a step's start, a pull just started is waited for at most this long, and at most this share of the
# last step: the request it carries then joins this step, at that small cost to the others in it.
MAX_JOIN_WAIT_S = 0.015
JOIN_WAIT_SHARE = 0.2
WITHDRAWN_CLAIM_POLL_S = 0.05  # the idle loop's poll while only claims for withdrawn KV may still come


@dataclasses.dataclass
class _Entry:
    request: DecodeRequest
    on_output: OutputCallback
    queued: float
    transfer_started: float | None = None
    transfer_finished: float | None = None
    admitted: float | None = None
    transfer_bytes: int = 0
    is_aborted: bool = False
    abort_reason: str = "abort"  # the finish_reason an aborted request ends with ("migrate": evacuated)


class DecodeWorker:
    def __init__(self, worker_id: str, engine: LLMEngine, receiver: KVReceiver,
                 deliver_pull: Callable[[PullRequest], None] | None = None,
                 release_source: Callable[[KVHandle, str], None] | None = None,
                 on_step_end: Callable[[], None] | None = None,
                 wake: Callable[[], None] | None = None, migration: MigrationOffers | None = None) -> None:
        """Args:
        deliver_pull: carries a PullRequest to its prefill worker (backends whose sender takes part);
            the reply comes back through on_pull_reply().
        release_source: tells a handle's prefill worker that nobody will pull it (with why), so that it
            frees the blocks now. Called on the loop thread; must not block.
        on_step_end: called on the loop thread after each step (and after fail()) has handed out its
            outputs, so that a caller can send one message per step instead of one per request.
        wake: wakes the step loop; given, a PullWatcher thread watches the pulls and wakes the loop when one
            ends (start it with start_watching()); without it, pulls are polled at each step only.
        migration: offers evacuated streams' KV to the worker that continues them; None: they are
            recomputed there.
        """
        self.worker_id = worker_id
        self.engine = engine
        self.receiver = receiver
        self.deliver_pull = deliver_pull
        self.release_source = release_source
        self.on_step_end = on_step_end or (lambda: None)
        self.migration = migration
        self._wake = wake or (lambda: None)
        self._pulls = PullWatcher(receiver, self._wake, deliver_pull, f"pulls-{worker_id}")
        self._is_watching = False
        # Commands from other threads, run by the loop thread at the start of its next step.
        self._inbox: WorkerInbox[tuple[DecodeRequest, OutputCallback, float]] = WorkerInbox(
            f"decode worker {worker_id}")
        self._entries: dict[str, _Entry] = {}
        self._groups = ChoiceGroups()  # requests with several choices, until their pull ends
        self._awaiting_blocks: collections.deque[str] = collections.deque()
        self._transferring: dict[tuple[str, int], str] = {}
        self._in_step: tuple[str, ...] = ()  # the requests of the forward under way (suspects if it raises)
        config = engine.config
        self._slicer = PrefillSlicer(config.max_prefill_s_beside_decode, config.max_num_batched_tokens)
        self._last_step_s = 0.0  # the last forward's duration (bounds the wait for a pull at a step's start)
        self._load = self._snapshot()

    # Called from any thread.
    def submit(self, request: DecodeRequest, on_output: OutputCallback) -> None:
        """Queue a request; raises ValueError at once if it can never be served here."""
        self.engine.check_request(request.prompt_token_ids, request.sampling)
        queued = time.time()
        self._inbox.submit(request.request_id, (request, on_output, queued),
                           lambda: self._accept(request, on_output, queued))

    def abort(self, request_id: str) -> None:
        self._inbox.post(lambda: self._abort(request_id))

    def start_watching(self) -> None:
        """Watch pulls on a thread of their own (see the PullWatcher), and poll the migration sender on one
        (decode_pool.migration); stop_watching() before closing."""
        self._pulls.start()
        self._is_watching = True
        if self.migration is not None:
            self.migration.start_polling(self._wake)

    def stop_watching(self) -> None:
        self._pulls.stop()

    def evacuate(self) -> None:
        """End every request here with finish_reason "migrate", freeing its blocks (see the lifecycle)."""
        self._inbox.post(self._evacuate)

    def move_out(self, request_ids: list[str]) -> None:
        """Hand these requests back (finish_reason "migrate"), as evacuate() does, for the gateway to continue
        on another worker: a running stream with its KV offered, a prompt not started yet as it came (the
        gateway routes it again). One mid-prefill, or whose KV cannot be offered (no migration sender),
        stays here."""
        self._inbox.post(lambda: self._move_out(request_ids))

    def release(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this migrating stream's KV: free its blocks now rather than at the lease's end."""
        if self.migration is not None:
            migration = self.migration
            self._inbox.post(lambda: migration.release(transfer_id, why))

    def add_peer(self, peer: PeerInfo) -> None:
        """Learn a sender. A peer this worker can never pull from (another layout, another backend) is
        refused here, in the caller (the fleet's wiring fails, not this worker); an error of the transfer
        library while adding it is logged on the step thread and the peer stays unknown (pulls from it are
        refused and recomputed): neither kills the step loop.

        Raises:
            IncompatibleLayoutError, ValueError: as KVReceiver.check_peer.
        """
        self.receiver.check_peer(peer)
        self._inbox.post(lambda: self._peer_command(f"adding peer {peer.worker_id}",
                                                    lambda: self.receiver.add_peer(peer)))

    def remove_peer(self, worker_id: str) -> None:
        self._inbox.post(lambda: self._peer_command(f"removing peer {worker_id}",
                                                    lambda: self.receiver.remove_peer(worker_id)))

    def _peer_command(self, what: str, call: Callable[[], None]) -> None:
        try:
            self._with_receiver(call)
        except Exception:  # one peer's trouble, not this worker's: its streams go on
            logger.exception("%s failed; the worker serves on without it", what)

    def on_pull_reply(self, reply: PullReply) -> None:
        self._inbox.post(lambda: self._with_receiver(lambda: self.receiver.on_pull_reply(reply)))

    def _with_receiver(self, call: Callable[[], None]) -> None:
        with self._pulls.lock:
            call()

    @property
    def failure(self) -> str:
        """Why the step loop died; empty while it serves."""
        return self._inbox.failure

    def fail(self, error: BaseException) -> None:
        """The step loop died: answer every request still here with an error (called on the loop thread)."""
        arriving = self._inbox.fail(error)
        now = time.time()
        message = f"decode worker failed: {self.failure}"
        for request, on_output, _ in arriving:
            self._release_unpulled(request, "the decode worker failed")
            on_output(DecodeOutput(request.request_id, (), (), now, finish_reason="error", error=message))
        suspects = set(self._in_step)
        for request_id, entry in list(self._entries.items()):
            if entry.transfer_finished is None:
                self._release_unpulled(entry.request, "the decode worker failed")
            self._finish(request_id, "error", now, DecodeOutput(
                request_id, (), (), now, finish_reason="error", error=message,
                in_failed_step=request_id in suspects))
        self._load = dataclasses.replace(self._load, failure=self.failure)
        self.on_step_end()

    # Called only from the step loop's thread.
    def step(self) -> float | None:
        """Inbox → admission → transfers → one forward → stream; returns the wait before the next step."""
        try:
            return self._step()
        finally:
            self.on_step_end()

    def _step(self) -> float | None:
        self._inbox.drain()
        if self.migration is not None:
            self.migration.poll()
        num_started = self._admit()
        if num_started and self._is_watching and self.engine.scheduler.running:
            # A pull takes milliseconds: wait for it (briefly) so that the request joins this step rather
            # than the next; a moved stream would otherwise miss one more of this worker's steps.
            self._pulls.wait_finished(min(MAX_JOIN_WAIT_S, JOIN_WAIT_SHARE * self._last_step_s))
        for result, finished_at in self._pulls.take():
            self._on_transfer_result(result.source_worker_id, result.transfer_id, result.state, result.reason,
                                     finished_at=finished_at)
        scheduler = self.engine.scheduler
        scheduler.prefill_budget_beside_decode = self._slicer.budget()
        batch = scheduler.schedule() if scheduler.num_unfinished else None
        if batch is not None and batch.chunks:
            # What the inbox just handed over is in no load report until this step ends: report it now, or a
            # request taken in this step looks like nowhere (neither arriving nor held) for the step's length.
            self._load = self._snapshot()
            self._in_step = tuple(chunk.request_id for chunk in batch.chunks)
            output = self.engine.runner.execute(batch)
            now = time.time()
            step = self.engine.runner.timeline.last
            if step is not None:
                self._last_step_s = step.duration_ms / 1000
                self._slicer.observe(step.duration_ms / 1000, step.num_prefill_tokens, step.num_decode_tokens)
            for request in scheduler.update(batch, output):
                self._emit(request, now)
            self._in_step = ()
            self._load = self._snapshot()
            return 0.0
        self._load = self._snapshot()
        # Nothing to compute (idle, or every waiting request needs blocks): sleep until woken (a submission,
        # an abort, the end of a pull), since a pull's end is what frees or fills blocks; without a watcher
        # thread, poll the receiver while pulls run.
        # The migration sender answers pulls from this loop: poll it while its leases are out.
        is_polling = (self._transferring and not self._is_watching) or self._num_offered
        if is_polling:
            return TRANSFER_POLL_S
        # A claim for withdrawn migration KV may still come: refuse it soon, whoever waits for it.
        is_claimable = self.migration is not None and self.migration.sender.expects_claims
        return WITHDRAWN_CLAIM_POLL_S if is_claimable else None

    @property
    def _num_offered(self) -> int:
        return self.migration.num_outstanding if self.migration is not None else 0

    def load(self) -> WorkerLoad:
        """The loop thread's latest snapshot (never reads the scheduler from another thread)."""
        load = self._load
        return dataclasses.replace(load, num_requests=load.num_requests + self._inbox.num_arriving)

    def _snapshot(self) -> WorkerLoad:
        scheduler = self.engine.scheduler
        return WorkerLoad(
            worker_id=self.worker_id, role="decode",
            num_waiting=len(self._awaiting_blocks) + len(scheduler.waiting),
            num_queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in scheduler.waiting),
            num_running=len(scheduler.running), num_transferring=len(self._transferring),
            num_free_blocks=self.engine.block_pool.num_free_blocks,
            num_total_blocks=self.engine.block_pool.num_blocks,
            num_outstanding_tokens=sum(e.request.sampling.max_tokens * self._groups.num_choices(r)
                                       for r, e in self._entries.items()),
            failure=self.failure, num_requests=len(self._entries) + self._num_offered,
        )

    def _accept(self, request: DecodeRequest, on_output: OutputCallback, queued: float) -> None:
        self._inbox.take(request.request_id)
        self._entries[request.request_id] = _Entry(request, on_output, queued)
        if request.choices:
            self._groups.add(request)
        handle = request.kv_handle
        if handle is not None and request.generated_token_ids and (
                handle.num_tokens != len(request.prompt_token_ids) + len(request.generated_token_ids) - 1):
            # A moved stream's KV must cover everything but its last token; anything else is recomputed.
            logger.warning("migrated KV of %s covers %d tokens, not prompt + tokens so far - 1; recomputing",
                           request.request_id, handle.num_tokens)
            self._release_unpulled(request, "the KV does not match the tokens so far")
            self._start_local(request.request_id)
        elif handle is None:
            if request.choices:  # the gateway sends groups with a handle only; recompute each choice
                self._split(request.request_id, pulled=False)
            else:
                self._start_local(request.request_id)
        else:
            self._awaiting_blocks.append(request.request_id)

    def _admit(self) -> int:
        """Start pulls, oldest first, while blocks for the prompt plus the watermark reserve are free;
        returns how many started."""
        pool = self.engine.block_pool
        num_started = 0
        while self._awaiting_blocks:
            entry = self._entries[self._awaiting_blocks[0]]
            handle = entry.request.kv_handle
            assert handle is not None
            busy = self.engine.scheduler.num_unfinished or self._transferring
            reserve = self.engine.scheduler.watermark_blocks if busy else 0
            # Several choices: room for each one's copy of the partial last block too (fork_blocks).
            num_copies = self.engine.kv.num_fork_blocks(handle.num_tokens, len(entry.request.choices) or 1)
            num_blocks = blocks_for(handle.num_tokens, self.engine.config.block_size) + num_copies
            if not pool.can_allocate(num_blocks + reserve):
                return num_started
            self._awaiting_blocks.popleft()
            request_id = entry.request.request_id
            dst = self.engine.kv.allocate_blocks(request_id, handle.num_tokens)
            entry.transfer_started = time.time()
            entry.transfer_bytes = len(dst) * self.engine.runner.cache_spec.block_bytes
            try:
                with self._pulls.lock:
                    self.receiver.start_pull(handle, dst)
                    self._pulls.watch()
            except (KeyError, ValueError) as error:
                logger.warning("pull for %s refused (%s); recomputing the prompt here", request_id, error)
                self._on_transfer_result(handle.source_worker_id, handle.transfer_id, TransferState.FAILED,
                                         str(error), request_id)
                continue
            self._transferring[(handle.source_worker_id, handle.transfer_id)] = request_id
            num_started += 1
        return num_started

    def _on_transfer_result(self, source: str, transfer_id: int, state: TransferState, reason: str,
                            request_id: str | None = None, finished_at: float | None = None) -> None:
        request_id = request_id or self._transferring.pop((source, transfer_id), None)
        if request_id is None:
            return
        entry = self._entries[request_id]
        entry.transfer_finished = finished_at or time.time()
        if state is not TransferState.DONE:
            self._release_unpulled(entry.request, "aborted during the pull" if entry.is_aborted else reason)
        if entry.is_aborted:
            self.engine.kv.free(request_id)
            self._finish(request_id, entry.abort_reason, entry.transfer_finished)
            return
        request = entry.request
        assert request.kv_handle is not None
        if request.choices:
            self._split(request_id, pulled=state is TransferState.DONE)
            return
        if request.generated_token_ids:  # a stream moved here from a worker that evacuated it
            output_token_ids, output_logprobs = list(request.generated_token_ids), []
        else:
            assert request.first_token_id is not None
            output_token_ids = [request.first_token_id]
            output_logprobs = [] if request.first_logprob is None else [request.first_logprob]
        engine_request = Request(
            request_id, list(request.prompt_token_ids), request.sampling,
            frozenset(self.engine.spec.eos_token_ids), output_token_ids=output_token_ids,
            output_logprobs=output_logprobs,
            output_top_logprobs=[request.first_top_logprobs] if request.first_top_logprobs else [],
            is_suspect=request.is_suspect,
        )
        if state is TransferState.DONE:
            engine_request.num_computed_tokens = request.kv_handle.num_tokens
            self.engine.scheduler.add_running(engine_request)
            entry.admitted = time.time()
        else:
            logger.warning("pull for %s failed (%s); recomputing the prompt here", request_id, reason)
            self.engine.kv.free(request_id)
            entry.transfer_bytes = 0
            self.engine.scheduler.add(engine_request)

    def _split(self, group_id: str, pulled: bool) -> None:
        """A group's pull ended (or it never had one): each remaining choice goes on as a request of its own,
        forked from the pulled blocks when `pulled` and there is room for the copies, else recomputed."""
        entry = self._entries.pop(group_id)
        handle = entry.request.kv_handle
        parts = self._groups.split(entry.request, frozenset(self.engine.spec.eos_token_ids))
        kv = self.engine.kv
        num_tokens = handle.num_tokens if handle is not None else 0
        pulled = pulled and self.engine.block_pool.can_allocate(kv.num_fork_blocks(num_tokens, len(parts)))
        if pulled and parts:
            self.engine.fork_blocks(group_id, [request.request_id for request, _ in parts], num_tokens)
        else:
            kv.free(group_id)
        now = time.time()
        for request, engine_request in parts:
            # Each choice reports the group's one pull (the gateway's timings read one choice's).
            self._entries[request.request_id] = dataclasses.replace(
                entry, request=request, admitted=now if pulled else None,
                transfer_bytes=entry.transfer_bytes if pulled else 0)
            if pulled:
                engine_request.num_computed_tokens = num_tokens
                self.engine.scheduler.add_running(engine_request)
            else:
                self.engine.scheduler.add(engine_request)

    def _start_local(self, request_id: str) -> None:
        entry = self._entries[request_id]
        request = entry.request
        eos = frozenset(self.engine.spec.eos_token_ids)
        self.engine.scheduler.add(Request(request_id, list(request.prompt_token_ids), request.sampling, eos,
                                          output_token_ids=list(request.generated_token_ids),
                                          is_suspect=request.is_suspect))

    def _release_unpulled(self, request: DecodeRequest, why: str) -> None:
        if request.kv_handle is not None and self.release_source is not None:
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
            output = dataclasses.replace(output, finish_reason=request.status.value,
                                         num_preemptions=request.num_preemptions,
                                         num_cached_tokens=request.num_cached_tokens)
            self._finish(request.request_id, request.status.value, now, output)
        else:
            entry.on_output(output)

    def _evacuate(self) -> None:
        for request_id in list(self._entries):
            if not (self._hand_back_unpulled(request_id) or self._offer_for_migration(request_id)):
                self._abort(request_id, "migrate")

    def _move_out(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id not in self._entries or self._offer_for_migration(request_id):
                continue
            request = self.engine.scheduler.requests.get(request_id)
            if request is not None and not request.num_computed_tokens and not request.num_output_tokens:
                self._abort(request_id, "migrate")  # a prompt not started here: the gateway routes it again

    def _hand_back_unpulled(self, request_id: str) -> bool:
        """Hand a request whose pull has not started back with its handle, unused: the next worker pulls the
        KV from where it is (the prefill worker) instead of recomputing it. False: its pull has started."""
        if request_id not in self._awaiting_blocks or self._groups.is_group(request_id):
            return False  # pulling already; or several choices, which cannot share one handle elsewhere
        self._awaiting_blocks.remove(request_id)
        handle = self._entries[request_id].request.kv_handle
        now = time.time()
        self._finish(request_id, "migrate", now,
                     DecodeOutput(request_id, (), (), now, finish_reason="migrate", kv_handle=handle))
        return True

    def _offer_for_migration(self, request_id: str) -> bool:
        """Hand a running stream back with its KV offered (see the lifecycle); False: not possible here."""
        scheduler = self.engine.scheduler
        request = scheduler.requests.get(request_id)
        if (self.migration is None or request is None or not request.num_output_tokens
                or request.num_computed_tokens != request.num_tokens - 1):
            return False  # no sender, not running, or mid-prefill: evacuated without KV
        if scheduler.detach(request_id) is None:
            return False
        handle = self.migration.offer(request)
        now = time.time()
        self._finish(request_id, "migrate", now,
                     DecodeOutput(request_id, (), (), now, finish_reason="migrate", kv_handle=handle))
        return True

    def _abort(self, request_id: str, reason: str = "abort") -> None:
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
        if request_id in self._awaiting_blocks:
            self._awaiting_blocks.remove(request_id)
            self._release_unpulled(entry.request, "aborted before its pull")
        elif request_id in self._transferring.values():
            # The pull may still write into the blocks: free them when it ends, now if it can be stopped
            # (before its READ, or a READ NIXL cancels), else at its end or deadline.
            entry.is_aborted = True
            handle = entry.request.kv_handle
            assert handle is not None
            with self._pulls.lock:
                self.receiver.cancel(handle.source_worker_id, handle.transfer_id, "the request was aborted")
            return
        else:
            self.engine.scheduler.abort(request_id)
        self._finish(request_id, reason, time.time())

    def _finish(self, request_id: str, reason: str, now: float, output: DecodeOutput | None = None,
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
