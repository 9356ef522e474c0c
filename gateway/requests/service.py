"""The gateway's request path, independent of HTTP framing.

(gateway/api/prepare.py turns an OpenAI request into the PreparedRequest that starts here.)
admit():     reserve decode KV capacity for prompt + n × max_tokens (bounded wait, else Overloaded → 429)
stream():    route through both pools (within the request's deadlines, counted from admission; worker
             failures are retried or migrated by the orchestrator) → incremental detokenization, stop
             strings → TextDelta events; the last one carries finish_reason, usage counts and the stage
             Timings (also exported to Prometheus, and as a trace with --otlp-traces-endpoint). The
             request runs in a task of its own, ahead of the client's reading: its reservation is released
             when the workers are done with it, read or not, and the HTTP edge cuts a reader stalled past
             send_by() (finish_by + a grace). Leaving the stream early (client gone, stop string) aborts
             both workers. A request that cannot finish raises RequestFailed (HTTP 503, or an error event
             mid-stream).
             With n > 1 choices (gateway/requests/choices.py), each choice has its own detokenizer, stop
             strings and final delta (`index`); a stop string ends only its choice; the request's last
             delta carries the Timings (of its longest choice).
Tokens are counted one by one, each with its own time (gateway/requests/stage_timings.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from decode_pool.messages import DecodeOutput
from gateway.requests.admission import Admission, Reservation
from gateway.requests.choices import ChoicesRun
from gateway.requests.deadlines import DeadlinePolicy, RequestDeadlines
from gateway.requests.detokenizer import IncrementalDetokenizer
from gateway.requests.events import FailureCode, RequestFailed
from gateway.requests.fleet_view import FleetView
from gateway.requests.orchestrator import RequestRun
from gateway.requests.prepared import PreparedRequest, TextDelta
from gateway.requests.router import LocalPrefillPolicy, Router
from gateway.requests.stage_timings import stage_timings, token_times
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer, TracedRequest
from gateway.telemetry.traffic import TrafficNote
from llm_engine.finish_reason import FinishReason
from prefill_pool.messages import PrefillResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

DELIVERY_GRACE_S = 30.0


@dataclass
class _Choice:
    """One choice's way through the gateway: its text so far, and when each of its tokens left."""

    detokenizer: IncrementalDetokenizer
    sent: list[float] = dataclasses.field(default_factory=list)  # ≤ max_tokens entries
    is_finished: bool = False


class GatewayService:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        fleet: FleetView,
        admission: Admission,
        max_request_tokens: int,
        deadline_policy: DeadlinePolicy | None = None,
        local_prefill: LocalPrefillPolicy | None = None,
        metrics: Metrics | None = None,
        tracer: RequestTracer | None = None,
        shows_prompt_cache: bool = False,
    ) -> None:
        """Args:
        fleet: the workers (a frontend's mirror of the fleet actor's); told of every prompt routed, every
            request finished and every arrival (the fleet's controller and planners read them).
        admission: its capacity is this frontend's share of the decode KV, leased by the fleet.
        metrics: this gateway's Prometheus series (default: a set labelled with model_name).
        tracer: where finished requests' traces go (--otlp-traces-endpoint); None: not traced.
        shows_prompt_cache: responses carry the prompt tokens found cached and why a decode worker prefilled
            (--enable-prompt-tokens-details); off, only the metrics and traces (the operator's) have them.
        """
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.fleet = fleet
        self.router = Router(fleet, local_prefill)
        self.router.on_local_prefill.append(fleet.note_prompt)  # a decode worker prefills a prompt itself
        self.admission = admission
        self.shows_prompt_cache = shows_prompt_cache
        self.metrics = metrics or Metrics(model_name)
        admission.on_change.append(self._admission_changed)
        self.tracer = tracer
        self.max_request_tokens = max_request_tokens  # KV one decode worker can hold for one request
        self.deadline_policy = deadline_policy or DeadlinePolicy()
        self._open: set[asyncio.Queue[TextDelta | Exception | None]] = set()  # each open request's deltas
        # Past the request's finish_by, how long a client may take to read the rest before it is cut.
        self.delivery_grace_s = DELIVERY_GRACE_S

    # Admission and generation.
    def try_admit(self, prepared: PreparedRequest) -> Reservation | None:
        """The request's reservation when it needs no wait in line (the common case); None otherwise.
        Every route asks this first: the request counts in the recent traffic from here, before it waits."""
        self._note_traffic(prepared)
        return self.admission.try_acquire(self.num_reserved_tokens(prepared))

    def _note_traffic(self, prepared: PreparedRequest, num_output: int | None = None) -> None:
        """The request arrived (num_output None) or finished: the fleet's planners count it."""
        self.fleet.note_traffic(TrafficNote(prepared.request_id, prepared.arrival,
                                            len(prepared.prompt_token_ids),
                                            prepared.sampling.n * prepared.sampling.max_tokens, num_output))

    @staticmethod
    def num_reserved_tokens(prepared: PreparedRequest) -> int:
        """Decode KV the request may take: its prompt once (its choices share it), each choice's tokens."""
        sampling = prepared.sampling
        return len(prepared.prompt_token_ids) + sampling.n * sampling.max_tokens

    async def admit(self, prepared: PreparedRequest) -> Reservation:
        return await self.admission.acquire(self.num_reserved_tokens(prepared), prepared.priority)

    def _admission_changed(self) -> None:
        self.metrics.observe_admission(self.admission.num_waiting, self.admission.reserved_tokens)

    def deadlines(self, prepared: PreparedRequest, reservation: Reservation) -> RequestDeadlines:
        """The request's deadlines, counted from its admission."""
        return self.deadline_policy.for_request(prepared.arrival, len(prepared.prompt_token_ids),
                                                prepared.sampling.max_tokens, reservation.admitted)

    def send_by(self, prepared: PreparedRequest, reservation: Reservation) -> float:
        """When the response must have reached the client (time.time()): a reader stalled past it is cut."""
        return self.deadlines(prepared, reservation).finish_by + self.delivery_grace_s

    async def stream(
        self, prepared: PreparedRequest, reservation: Reservation
    ) -> AsyncGenerator[TextDelta, None]:
        """The request's deltas. The request runs in a task of its own, ahead of the reader: its end (the
        worker's final output) releases the reservation and the workers whether or not the client has read
        that far. Closing this generator early aborts the request."""
        deltas: asyncio.Queue[TextDelta | Exception | None] = asyncio.Queue()  # ≤ max_tokens + 2 items
        run = asyncio.create_task(self._run(prepared, reservation, deltas))
        self._open.add(deltas)
        num_open = prepared.sampling.n  # choices without their final delta yet

        def ended(task: asyncio.Task[None]) -> None:  # last in line, whatever ended the request
            error = None if task.cancelled() else task.exception()
            deltas.put_nowait(error if isinstance(error, Exception) else None)

        run.add_done_callback(ended)
        try:
            while (delta := await deltas.get()) is not None:
                if isinstance(delta, Exception):
                    raise delta
                yield delta
                num_open -= delta.finish_reason is not None
                if not num_open:
                    return
        finally:
            self._open.discard(deltas)
            try:
                if not run.done():
                    run.cancel()  # its own cleanup aborts both workers
                    await asyncio.wait({run})
            finally:
                reservation.release()

    def end_open_requests(self) -> int:
        """The server is stopping (gateway/stop_signals.py): every request still open ends now with a clear
        error, its workers aborted. Returns how many."""
        stopping = RequestFailed("the server is shutting down: send the request again",
                                 FailureCode.SHUTTING_DOWN)
        for deltas in self._open:
            deltas.put_nowait(stopping)  # read before anything the request adds after it
        return len(self._open)

    async def _run(self, prepared: PreparedRequest, reservation: Reservation,
                   deltas: asyncio.Queue[TextDelta | Exception | None]) -> None:
        """The request, from routing to its final delta in `deltas` (or raises RequestFailed)."""
        choices = [_Choice(IncrementalDetokenizer(self.tokenizer, prepared.stop_strings,
                                                  prepared.skip_special_tokens,
                                                  prepared.include_stop_str_in_output))
                   for _ in range(prepared.sampling.n)]
        num_open = len(choices)
        prefill: PrefillResult | None = None
        decode: DecodeOutput | None = None
        prefilled_by = ""
        outcome = "abort"
        deadlines = self.deadlines(prepared, reservation)
        self.fleet.note_prompt(len(prepared.prompt_token_ids))
        run = self._request_run(prepared, deadlines)
        events = run.events()
        try:
            async for event in events:
                choice = choices[event.index]
                if choice.is_finished:
                    continue  # a choice cut at a stop string: what its worker sent before it stopped
                if prepared.is_prompt_only:  # the prompt's logprobs are the answer; its token is dropped
                    event = dataclasses.replace(event, token_ids=(), logprobs=(), top_logprobs=(),
                                                token_times=(), finish_reason=FinishReason.LENGTH)
                prefill = event.prefill or prefill
                decode = event.decode or decode
                prefilled_by = event.prefilled_by or prefilled_by
                shown = event.token_ids
                if event.finish_reason == "stop" and not prepared.include_stop_str_in_output:
                    shown = shown[:-1]  # as vLLM: the EOS or stop token that ended it is not text
                text = choice.detokenizer.add(shown)
                finish = "stop" if choice.detokenizer.is_stopped else event.finish_reason
                choice.sent.extend(token_times(event, time.time()))
                if event.num_migrations and event.finish_reason is not None:
                    self.metrics.migrations.inc(event.num_migrations)
                if finish is None:
                    deltas.put_nowait(TextDelta(text, event.token_ids, event.logprobs, None, len(choice.sent),
                                                top_logprobs=event.top_logprobs,
                                                prompt_logprobs=event.prompt_logprobs, index=event.index))
                    continue
                text += choice.detokenizer.flush()
                choice.is_finished = True
                num_open -= 1
                if num_open:  # another choice goes on; this one ends here (cut on its worker if need be)
                    if event.finish_reason is None and isinstance(run, ChoicesRun):
                        run.stop(event.index)
                    deltas.put_nowait(TextDelta(text, event.token_ids, event.logprobs, finish,
                                                len(choice.sent), top_logprobs=event.top_logprobs,
                                                prompt_logprobs=event.prompt_logprobs, index=event.index))
                    continue
                # The request's timings follow its longest choice (all of them when n = 1).
                sent = max((c.sent for c in choices), key=len)
                num_output = sum(len(c.sent) for c in choices)
                timings = stage_timings(prepared.arrival, reservation.admitted, sent, prefill, decode)
                if event.local_prefill_reason:
                    timings.prefill_on, timings.local_prefill_reason = "decode", event.local_prefill_reason
                timings.num_moves = event.num_migrations + event.num_moves
                num_prompt = len(prepared.prompt_token_ids)
                # The prefilling worker's count: the prefill pool's, or the decode worker's own prefill.
                cached = prefill.num_cached_tokens if prefill else decode.num_cached_tokens if decode else 0
                timings.cached_tokens = min(cached, num_prompt)
                outcome = finish
                self.metrics.observe_request(timings, finish, num_prompt, num_output,
                                             decode.num_preemptions if decode else 0, prepared.sampling.n,
                                             prepared.sampling.max_tokens, len(sent))
                if prefilled_by:
                    self.metrics.observe_prefix_cache(prefilled_by, num_prompt, timings.cached_tokens)
                if self.tracer is not None:
                    self.tracer.record(self._traced(prepared, num_output), timings)
                self._note_traffic(prepared, num_output)
                self.fleet.note_finished(timings)
                shown_timings = timings if self.shows_prompt_cache else timings.model_copy(
                    update={"cached_tokens": None, "local_prefill_reason": None})
                deltas.put_nowait(TextDelta(text, event.token_ids, event.logprobs, finish, len(choice.sent),
                                            shown_timings, shown_timings.cached_tokens or 0,
                                            event.top_logprobs, event.prompt_logprobs, event.index))
                return
        except RequestFailed as failed:
            outcome = "error"
            self.metrics.observe_ended("error", failed.code)
            raise
        finally:
            try:
                await events.aclose()  # aborts both workers unless the request finished there
            finally:  # even when this task is cancelled meanwhile (its reader closed the stream)
                reservation.release()  # the request holds no worker now, read or not
                if outcome == "abort":
                    self.metrics.observe_ended("abort")

    def _traced(self, prepared: PreparedRequest, num_output: int) -> TracedRequest:
        sampling = prepared.sampling
        return TracedRequest(prepared.request_id, self.model_name, prepared.arrival,
                             len(prepared.prompt_token_ids), num_output, sampling.max_tokens,
                             sampling.temperature, sampling.top_p, sampling.n, prepared.trace_headers)

    def _request_run(self, prepared: PreparedRequest, deadlines: RequestDeadlines) -> RequestRun:
        """One request's way through both stages: its choices' when it has several."""
        run_cls = ChoicesRun if prepared.sampling.n > 1 else RequestRun
        return run_cls(self.router, prepared.request_id, prepared.prompt_token_ids, prepared.sampling,
                       deadlines, prepared.block_hashes)
