"""The one worker skeleton: what a prefill and a decode worker share around the engine's one forward. A
role is its step policy, a subclass filling in a few hooks (PrefillWorker: prefill_pool/worker.py;
DecodeWorker, also the mixed role: decode_pool/worker.py). The actor (pool_worker/actor.py) calls the worker,
the worker the engine: every remote method is forwarded once.

Lifecycle of a worker:
    built over the engine (the role's create() sets its scheduler and builds its transfer endpoints)
    → start(): the StepLoop's thread, and the offers' polling thread (worker_runtime/kv_offers.py)
    → serves: submit() / submit_to() / abort() / release_kv() / accept_pull() and the role's own commands,
      from any thread, through the INBOX, each waking the loop
    → close(): the loop stops, the transfer endpoints deregister. The engine (weights, KV cache) outlives the
      worker: the actor builds another over it when the worker changes role.
One step (the loop thread):
    INBOX drained → offered KV polled (leases that ended free their blocks) → _before_step()
    → engine.forward_step(_before_forward) → _after_forward(forward): each advanced request's output
    → the load snapshot published → the step's outputs flushed to the OutputChannels in one call.
    Returns 0 after a forward, else _idle_wait() (None: sleep until woken).
A step that raises ends the loop: fail() answers everything the worker holds with an error (the role's
_fail_requests), and from then on submissions raise WorkerFailed.
An id is live from submit() until its last output (_is_final) leaves: the inbox refuses a second one.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kv_transfer import PeerInfo, PullReply, PullRequest, TransferRecord
from llm_engine.batch import ModelInput
from llm_engine.engine import ForwardStep, LLMEngine
from llm_engine.params import SamplingParams
from worker_runtime.inbox import WorkerInbox
from worker_runtime.kv_offers import KVOffers
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import Output, OutputChannels
from worker_runtime.roles import Role
from worker_runtime.step_loop import StepLoop


class Submitted(Protocol):
    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> tuple[int, ...]: ...
    @property
    def sampling(self) -> SamplingParams: ...


RequestT = TypeVar("RequestT", bound=Submitted)
OutputT = TypeVar("OutputT", bound=Output)


class StepWorker(abc.ABC, Generic[RequestT, OutputT]):
    role: Role  # the role's own (the actor reports MIXED for a decode worker serving mixed)

    def __init__(self, worker_id: str, engine: LLMEngine, offers: KVOffers | None,
                 outputs: OutputChannels | None = None, num_threads: int = 1) -> None:
        """Args:
        offers: the worker's offered KV (a prefill worker's prompts, a decode worker's handed-back streams);
            None: it offers none.
        outputs: the actor's channels, flushed at each step's end (None: tests that step by hand).
        """
        self.worker_id = worker_id
        self.engine = engine
        self.offers = offers
        self.outputs = outputs
        # Commands from other threads, run by the loop thread at the start of its next step.
        self._inbox: WorkerInbox[tuple[RequestT, Callable[[OutputT], None], float]] = WorkerInbox(
            f"{self.role.value} worker {worker_id}")
        self.loop = StepLoop(f"{self.role.value}-{worker_id}", self.step, num_threads, on_error=self.fail)
        self._event_loop: asyncio.AbstractEventLoop | None = None  # the actor's, for calls to other actors
        self._load = self._snapshot()

    # Any thread.
    def start(self) -> None:
        self.loop.start()
        if self.offers is not None:
            self.offers.start_polling(self.wake)

    def wake(self) -> None:
        self.loop.wake()

    def close(self) -> None:
        self.loop.stop()
        if self.offers is not None:
            self.offers.close()

    def submit(self, request: RequestT, on_output: Callable[[OutputT], None]) -> None:
        """Queue a request; its outputs go to on_output (on the loop thread). Raises ValueError (it can never
        be served here), DuplicateRequest (a live id) or WorkerFailed (the step loop died)."""
        self.engine.check_request(request.prompt_token_ids, request.sampling)
        queued = time.time()
        answer = self._settling(request, on_output)
        self._inbox.submit(request.request_id, (request, answer, queued),
                           lambda: self._accept(request, answer, queued), self._num_queued_tokens(request),
                           output_ids=self._output_ids(request))
        self.wake()

    def submit_to(self, request: RequestT, channel_id: str) -> None:
        """As submit(), its outputs going to the output channel `channel_id` (called on the actor's event
        loop, which calls to other actors then hop to)."""
        assert self.outputs is not None, "a worker without output channels is stepped by hand"
        self._event_loop = asyncio.get_running_loop()
        output_ids = self._output_ids(request)
        for output_id in output_ids:  # several choices stream under their own ids
            self.outputs.subscribe(output_id, channel_id)
        try:
            self.submit(request, self.outputs.collect)
        except BaseException:
            for output_id in output_ids:
                self.outputs.unsubscribe(output_id)
            raise

    def _settling(self, request: RequestT, on_output: Callable[[OutputT], None]) -> Callable[[OutputT], None]:
        """on_output, with each id settled in the inbox as its last output leaves (the request's own id with
        the last of its outputs' ids): from then on the worker holds nothing under it (offered KV belongs to
        its lease), and the id may come again."""
        open_ids = set(self._output_ids(request))

        def answer(output: OutputT) -> None:
            if self._is_final(output):
                open_ids.discard(output.request_id)
                self._inbox.settle(output.request_id, *(() if open_ids else (request.request_id,)))
            on_output(output)
        return answer

    def abort(self, request_id: str) -> None:
        self._post(lambda: self._abort(request_id))

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this offered KV (its pull failed, or the request ended): free its blocks now
        rather than when its lease ends."""
        if self.offers is not None:
            offers = self.offers
            self._post(lambda: offers.release(transfer_id, why))

    def accept_pull(self, pull: PullRequest) -> PullReply:
        """For backends whose sender takes part (torch): post the send leg of a pull."""
        if self.offers is None:
            raise RuntimeError(f"{self.worker_id} offers no KV")
        reply = self.offers.accept_pull(pull)
        self.wake()
        return reply

    def peer_info(self) -> PeerInfo:
        """The endpoint other workers pull this worker's offered KV from."""
        if self.offers is None:
            raise RuntimeError("this transfer backend cannot move KV between decode workers")
        return self.offers.peer_info()

    def fail_at_next_step(self, error: BaseException) -> None:
        """Have the step loop raise `error` at its next step, failing the worker the one way a worker fails
        (for what the actor finds broken from outside the loop: a tensor-parallel rank gone)."""
        def raise_it() -> None:
            raise error
        self._post(raise_it)

    def _post(self, command: Callable[[], None]) -> None:
        self._inbox.post(command)
        self.wake()

    @property
    def failure(self) -> str:
        """Why the step loop died; empty while it serves."""
        return self._inbox.failure

    def load(self) -> WorkerLoad:
        """The loop thread's latest snapshot, plus what is still in the inbox (never reads the scheduler from
        another thread)."""
        load = self._load
        queued = load.num_queued_prompt_tokens + self._inbox.num_tokens
        return dataclasses.replace(load, num_requests=load.num_requests + self._inbox.num_arriving,
                                   num_queued_prompt_tokens=queued)

    # The loop thread.
    def step(self) -> float | None:
        """One step (see the lifecycle); returns the wait before the next."""
        try:
            self._inbox.drain()
            if self.offers is not None:
                self.offers.poll()
            self._before_step()
            forward = self.engine.forward_step(self._before_forward)
            if forward is not None:
                self._after_forward(forward)
            self._load = self._snapshot()
            return 0.0 if forward is not None else self._idle_wait()
        finally:
            self._flush()

    def fail(self, error: BaseException) -> None:
        """The step loop died: answer every request still here with an error."""
        arriving = self._inbox.fail(error)
        self._fail_requests(error, arriving)
        self._load = dataclasses.replace(self._load, failure=self.failure)
        self._flush()

    def _flush(self) -> None:
        if self.outputs is not None:
            self.outputs.flush()

    def _before_forward(self, batch: ModelInput) -> None:
        # What the inbox just handed over is in no load report until this step ends: report it now, or a
        # request taken in this step looks like nowhere (neither arriving nor held) for the step's length.
        self._load = self._snapshot()

    # The role's step policy (loop thread, but for the first three).
    def _output_ids(self, request: RequestT) -> tuple[str, ...]:
        """The ids the request's outputs stream under."""
        return (request.request_id,)

    def _num_queued_tokens(self, request: RequestT) -> int:
        """Tokens a queued submission adds to the load's num_queued_prompt_tokens."""
        return 0

    @abc.abstractmethod
    def _is_final(self, output: OutputT) -> bool:
        """Whether the output is the last under its id."""

    @abc.abstractmethod
    def _accept(self, request: RequestT, on_output: Callable[[OutputT], None], queued: float) -> None:
        """Take a submission from the inbox."""

    @abc.abstractmethod
    def _abort(self, request_id: str) -> None:
        """End the request in whatever state it is, with finish_reason "abort"."""

    def _before_step(self) -> None:
        """After the inbox, before the forward."""

    @abc.abstractmethod
    def _after_forward(self, forward: ForwardStep) -> None:
        """Each advanced request's output."""

    def _idle_wait(self) -> float | None:
        """No forward ran: how long to sleep (None: until woken)."""
        return None

    @abc.abstractmethod
    def _fail_requests(self, error: BaseException,
                       arriving: list[tuple[RequestT, Callable[[OutputT], None], float]]) -> None:
        """Answer every request held, and `arriving` (the inbox's, untaken), with an error."""

    @abc.abstractmethod
    def _snapshot(self) -> WorkerLoad:
        """The load after this step (published whole: other threads only read the latest)."""

    @abc.abstractmethod
    def transfer_records(self) -> list[TransferRecord]:
        """The transfer endpoint's records (any thread)."""
