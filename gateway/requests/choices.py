"""One request with several choices (OpenAI's `n`) through both stages: one stream of events, each tagged with
its choice's index.

    pick a decode worker (booked for prompt + n × max_tokens)
      → PREFILL once, with sampling.n: the prefill worker draws every choice's first token from the prompt's
        last logits, each with its own seed (llm_engine/choices.py) → one event per choice
      → DECODE: one DecodeRequest for the choices that go on; the decode worker pulls the prompt's KV once
        and forks it (full blocks shared, the partial last block copied), one request per choice, whose
        outputs arrive under choice_request_id(request_id, index)
      → from there each choice is a stream of its own (decode_stage.decode_stream, pumped into one queue): its
        own retries and migrations (a moved choice takes its KV, or recomputes prompt + its tokens, where it
        goes), its own abort (stop(index), e.g. at a stop string), its own finish_reason.
The request ends when every choice has. Whatever stops the choices' streams (the end, the client leaving, a
choice that cannot finish: RequestFailed) stops them all, aborting each on the worker that holds it.
Layouts whose decode worker would prefill the prompt itself (a mixed worker, no prefill pool) run the choices
as n requests of their own instead, each with its own first token's seed (the prefix cache shares what it
can there); conditional disaggregation is not applied to several choices: they share one prefill.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from decode_pool.messages import DecodeRequest
from gateway.fleet.output_streams import RequestOutputs
from gateway.fleet.worker_errors import SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests import decode_stage, prefill_stage
from gateway.requests.deadlines import RequestDeadlines
from gateway.requests.events import FailureCode, RequestFailed, StreamEvent
from gateway.requests.orchestrator import RequestRun
from gateway.requests.router import Router
from llm_engine.choices import FirstToken, choice_request_id
from llm_engine.finish_reason import FinishReason
from llm_engine.params import SamplingParams
from prefill_pool.messages import PrefillResult
from worker_runtime.roles import Role

ChoiceStream = tuple[int, RequestRun, AsyncGenerator[StreamEvent, None]]  # a choice's index, run and stream


class ChoicesRun(RequestRun):
    """Drives a request with sampling.n > 1; `events()` is its stream, `stop(index)` ends one choice."""

    def __init__(self, router: Router, request_id: str, prompt_token_ids: tuple[int, ...],
                 sampling: SamplingParams, deadlines: RequestDeadlines,
                 block_hashes: list[bytes] | None = None) -> None:
        super().__init__(router, request_id, prompt_token_ids, sampling, deadlines, block_hashes)
        self._choices: list[RequestRun] = []  # each choice's own run, once it streams on its own
        self._pumps: dict[int, asyncio.Task[None]] = {}
        self._prefilled: tuple[Worker, PrefillResult] | None = None

    @staticmethod
    def _num_reserved(num_prompt_tokens: int, sampling: SamplingParams) -> int:
        return num_prompt_tokens + sampling.n * sampling.max_tokens  # the prompt once

    def stop(self, index: int) -> None:
        """End choice `index` (its stream closes, which aborts it on its worker); the others go on."""
        task = self._pumps.get(index)
        if task is not None:
            task.cancel()

    async def events(self) -> AsyncGenerator[StreamEvent, None]:
        queue: asyncio.Queue[StreamEvent | BaseException | None] = asyncio.Queue()  # ≤ n × (max_tokens + 2)
        try:
            firsts, streams = await self._start()
            for event in firsts:
                yield event
            for index, run, stream in streams:
                self._pumps[index] = asyncio.create_task(self._pump(index, run, stream, queue))
            num_open = len(streams)
            while num_open:
                item = await queue.get()
                if item is None:
                    num_open -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in self._pumps.values():
                task.cancel()
            try:
                await asyncio.gather(*self._pumps.values(), return_exceptions=True)
            finally:
                # Whether or not that wait ends: the request's task is cancelled during it whenever its
                # reader closes the stream on the last event (the usual end of a request with several
                # choices), and a booking left behind would hold every drain of that worker for good.
                for run in self._choices:
                    run.route.release()
                self.route.release()
                if self._prefilled is not None and self._prefilled[1].kv_handle is not None:
                    # Pulled already, being pulled, or never to be: the sender leaves the first two alone.
                    prefill, result = self._prefilled
                    prefill.client.release_kv(result.kv_handle.transfer_id, "the request ended")  # type: ignore[union-attr]

    @staticmethod
    async def _pump(index: int, run: RequestRun, stream: AsyncGenerator[StreamEvent, None],
                    queue: asyncio.Queue[StreamEvent | BaseException | None]) -> None:
        """One choice's events into the request's queue, then None; its booking is let go at its end (the
        request's own end may not wait for this one)."""
        try:
            async for event in stream:
                queue.put_nowait(dataclasses.replace(event, index=index))
        except asyncio.CancelledError:
            pass  # stopped: closing the stream aborted the choice where it ran
        except BaseException as error:  # RequestFailed, or anything unexpected: the request fails
            queue.put_nowait(error)
        finally:
            try:
                await stream.aclose()
            finally:
                run.route.release()
                queue.put_nowait(None)

    def _choice_run(self, index: int) -> RequestRun:
        state = self.state
        run = RequestRun(self.router, choice_request_id(state.request_id, index), state.prompt_token_ids,
                         state.sampling.for_choice(index), state.deadlines, state.block_hashes)
        self._choices.append(run)
        return run

    async def _start(self) -> tuple[list[StreamEvent], list[ChoiceStream]]:
        """Prefill once and hand the choices that go on to one decode worker: their first events and the
        streams that follow; or, where the decode worker would prefill, n requests of their own."""
        state, route = self.state, self.route
        decode = await route.pick_decode(state.deadlines.prefill_by)
        if decode.role is Role.MIXED or not route.has_prefill_pool():
            route.release()  # each choice books its own worker
            runs = [self._choice_run(i) for i in range(state.sampling.n)]
            return [], [(i, run, run.events()) for i, run in enumerate(runs)]
        prefill, result = await prefill_stage.prefill(state, route)
        self._prefilled = (prefill, result)
        if result.finish_reason == FinishReason.ABORT:  # refused by the worker: no token to send
            return [StreamEvent(choice_request_id(state.request_id, i), (), (), (), FinishReason.ABORT,
                                prefill=result, index=i) for i in range(state.sampling.n)], []
        firsts = [self._first_event(prefill, result, choice) for choice in result.choices]
        going_on = tuple(c for c in result.choices if c.finish_reason is None)
        if not going_on:
            return firsts, []
        group = DecodeRequest(state.new_attempt_id(), state.prompt_token_ids, state.sampling,
                              kv_handle=result.kv_handle, choices=going_on)
        submitted = await self._submit_group(decode, group)
        streams: list[ChoiceStream] = []
        for choice in going_on:
            run = self._choice_run(choice.index)
            run.state.generated.append(choice.token_id)
            # Used only if the choice must start again elsewhere: prompt + its first token, recomputed.
            request = DecodeRequest(run.state.new_attempt_id(), state.prompt_token_ids, run.state.sampling,
                                    generated_token_ids=(choice.token_id,))
            # The group's choice streams go under the group's attempt id; each choice's own attempts
            # (moves, retries) under its run's.
            outputs = submitted.get(choice_request_id(group.request_id, choice.index))
            stream = decode_stage.decode_stream(run.state, run.route, decode, request, outputs)
            streams.append((choice.index, run, stream))
        return firsts, streams

    def _first_event(self, prefill: Worker, result: PrefillResult, choice: FirstToken) -> StreamEvent:
        logprobs = () if choice.logprob is None or not self.state.sampling.logprobs else (choice.logprob,)
        return StreamEvent(choice_request_id(self.state.request_id, choice.index), (choice.token_id,),
                           logprobs, (result.times.finished,), choice.finish_reason,
                           (choice.top_logprobs,) if logprobs else (), result.prompt_logprobs, prefill=result,
                           prefilled_by=prefill.worker_id, index=choice.index)

    async def _submit_group(self, decode: Worker, group: DecodeRequest) -> dict[str, RequestOutputs]:
        """Submit the group once, each choice subscribed under its own id first; each choice's outputs. Empty
        when the worker did not take it: each choice then starts again on its own (recomputing prompt + its
        first token) and the prefill worker frees the KV at the request's end."""
        client = decode.client
        state, finish_by = self.state, self.state.deadlines.finish_by
        subscribed: dict[str, RequestOutputs] = {}
        self.route.at(f"handing its choices to {decode.worker_id}")
        try:
            for choice_id in group.output_request_ids:
                subscribed[choice_id] = client.subscribe(choice_id)
            # Within the request's deadline, as every other wait on a worker (nothing else would end it).
            async with asyncio.timeout(state.time_left(finish_by)):
                await client.submit_decode(group, next(iter(subscribed.values())))
        except (WorkerLost, WrongRoleError, SubmissionRefused) as error:
            if isinstance(error, WorkerLost):
                self.route.fleet.mark_failed(decode.worker_id, f"decode worker lost: {error}")
            for outputs in subscribed.values():
                client.unsubscribe(outputs)
            return {}
        except BaseException as error:
            for outputs in subscribed.values():
                client.unsubscribe(outputs)
            for choice_id in subscribed:
                client.abort(choice_id)
            if isinstance(error, TimeoutError):
                raise RequestFailed(state.late("decode", finish_by), FailureCode.DEADLINE_EXCEEDED) from None
            raise
        return subscribed
