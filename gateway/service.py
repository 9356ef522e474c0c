"""The gateway's request path, independent of HTTP framing.

prepare_*(): validate against the model (name, vocabulary, context), tokenize once and hash the prompt's
             blocks once (a long prompt in a worker thread, so the event loop keeps streaming)
             → PreparedRequest
admit():     reserve decode KV capacity for prompt + max_tokens (bounded wait, else Overloaded → 429)
stream():    route through both pools (within the request's deadlines; worker failures are retried or
             migrated by the orchestrator) → incremental detokenization, stop strings → TextDelta events;
             the last one carries finish_reason, usage counts and the stage Timings (also exported to
             Prometheus). Leaving the stream early (client gone, stop string) aborts both workers. A request
             that cannot finish raises RequestFailed (HTTP 503, or an error event mid-stream).
Tokens are counted one by one, each with its own time (gateway/timings.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

from jinja2 import TemplateError

from decode_pool.messages import DecodeOutput
from gateway.admission import Admission, Reservation
from gateway.deadlines import DeadlinePolicy
from gateway.detokenizer import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.orchestrator import RequestFailed, run_request
from gateway.pools import PDDeployment
from gateway.protocol import ChatCompletionRequest, CompletionRequest, Timings
from gateway.recent import RecentLatencies
from gateway.router import LocalPrefillPolicy, Router
from gateway.timings import stage_timings
from gateway.timings import token_times as _token_times  # tests import it from here
from llm_engine import ModelSpec, SamplingParams
from llm_engine.kv_cache_manager import prefix_hashes
from pool_worker import Role
from prefill_pool.messages import PrefillResult

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gateway.ratio_controller import RatioController

# Below these, sampling is greedy in all but name, and the sampler cannot take them: logits divided by a
# tiny temperature overflow to inf, and a top_p under float32's smallest value rounds to 0 and drops every
# token. Either way the probabilities are NaN, and that stops the worker's step loop.
MIN_TEMPERATURE = 1e-5  # as vLLM
MIN_TOP_P = 1e-6
# Prompts longer than these are tokenized / hashed in a worker thread: on the event loop they would stall
# every open stream for milliseconds (a 100k-character prompt takes tens), while a short one costs less than
# the hop to a thread.
LONG_PROMPT_CHARS = 4000
LONG_PROMPT_TOKENS = 1024
T = TypeVar("T")


class BadRequest(Exception):
    def __init__(
        self, message: str, status: int = 400, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_strings: list[str]
    arrival: float  # time.time() when the gateway received it
    block_hashes: list[bytes] | None = None  # prefix_hashes of the prompt (the router's cache matching)


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str | None = None
    num_output_tokens: int = 0  # tokens generated so far
    timings: Timings | None = None  # on the last delta
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (on the last delta)


class GatewayService:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        spec: ModelSpec,
        model_name: str,
        deployment: PDDeployment,
        admission: Admission,
        max_request_tokens: int,
        default_max_tokens: int,
        deadline_policy: DeadlinePolicy | None = None,
        local_prefill: LocalPrefillPolicy | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.spec = spec
        self.model_name = model_name
        self.deployment = deployment
        self.router = Router(deployment, local_prefill)
        self.admission = admission
        self.metrics = Metrics()
        self.max_request_tokens = max_request_tokens  # KV one decode worker can hold for one request
        self.default_max_tokens = default_max_tokens
        self.deadline_policy = deadline_policy or DeadlinePolicy()
        self.recent = RecentLatencies()  # the ratio controller's view of TTFT and ITL
        self.ratio_controller: RatioController | None = None  # told of every prompt as it is routed
        self._encode = _fast_encoder(tokenizer)
        # One thread: the tokenizer is not meant for concurrent use, and long prompts are rare.
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="prompt-prep")

    async def _off_loop_if(self, is_long: bool, work: Callable[[], T]) -> T:
        if not is_long:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, work)

    # Validation and tokenization.
    async def prepare_completion(self, request: CompletionRequest) -> PreparedRequest:
        self._check_model(request.model)
        if isinstance(request.prompt, str):
            text = request.prompt
            prompt = await self._off_loop_if(len(text) > LONG_PROMPT_CHARS,
                                             lambda: self._encode(text))
        else:
            prompt = list(request.prompt)
            bad = [t for t in prompt if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise BadRequest(
                    f"prompt token ids outside the vocabulary [0, {self.spec.vocab_size}): {bad[:5]}",
                    param="prompt",
                )
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        return await self._hashed(self._prepare(request, prompt, request.max_tokens or 16,
                                                request.logprobs is not None))

    async def prepare_chat(self, request: ChatCompletionRequest) -> PreparedRequest:
        self._check_model(request.model)
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"model {self.model_name} has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": m.text} for m in request.messages]
        is_long = sum(len(m["content"]) for m in messages) > LONG_PROMPT_CHARS
        try:
            encoded = await self._off_loop_if(is_long, lambda: self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True))
        except TemplateError as exc:  # the template refuses the conversation (e.g. roles that must alternate)
            raise BadRequest(f"the model's chat template refuses these messages: {exc.message}",
                             param="messages") from None
        # transformers 5 returns a BatchEncoding here; older versions a plain list.
        prompt = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # type: ignore[call-overload,index]
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(self.default_max_tokens, self.spec.max_model_len - len(prompt)))
        return await self._hashed(self._prepare(request, prompt, max_tokens, request.logprobs))

    async def _hashed(self, prepared: PreparedRequest) -> PreparedRequest:
        """With the prompt's block hashes, which the router needs for every prefill pick."""
        prompt = prepared.prompt_token_ids
        hashes = await self._off_loop_if(len(prompt) > LONG_PROMPT_TOKENS,
                                         lambda: prefix_hashes(prompt, self.router.block_size))
        return replace(prepared, block_hashes=hashes)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise BadRequest(
                f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def _prepare(
        self,
        request: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        max_tokens: int,
        logprobs: bool,
    ) -> PreparedRequest:
        total = len(prompt) + max_tokens
        if total > self.spec.max_model_len:
            raise BadRequest(
                f"this model's maximum context length is {self.spec.max_model_len} tokens; the "
                f"request asks for {total} ({len(prompt)} in the prompt, {max_tokens} to generate)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if total > self.max_request_tokens:
            raise BadRequest(
                f"the request needs KV for {total} tokens; one decode worker holds at most "
                f"{self.max_request_tokens}",
                param="max_tokens",
            )
        is_greedy = request.temperature < MIN_TEMPERATURE or request.top_p < MIN_TOP_P
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0 if is_greedy else request.temperature,
                top_p=request.top_p,
                top_k=max(0, request.top_k),
                seed=request.seed,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
            )
        except ValueError as error:
            raise BadRequest(str(error)) from None
        return PreparedRequest(
            f"req-{uuid.uuid4().hex}", tuple(prompt), sampling, request.stop_strings, time.time()
        )

    # Admission and generation.
    def try_admit(self, prepared: PreparedRequest) -> Reservation | None:
        """The request's reservation when it needs no wait in line (the common case); None otherwise."""
        return self.admission.try_acquire(len(prepared.prompt_token_ids) + prepared.sampling.max_tokens)

    async def admit(self, prepared: PreparedRequest) -> Reservation:
        reservation = await self.admission.acquire(
            len(prepared.prompt_token_ids) + prepared.sampling.max_tokens
        )
        self.metrics.admission_waiting.set(self.admission.num_waiting)
        self.metrics.admission_reserved.set(self.admission.reserved_tokens)
        return reservation

    async def stream(
        self, prepared: PreparedRequest, reservation: Reservation
    ) -> AsyncGenerator[TextDelta, None]:
        admitted = time.time()
        detokenizer = IncrementalDetokenizer(self.tokenizer, prepared.stop_strings)
        sent: list[float] = []
        prefill: PrefillResult | None = None
        decode: DecodeOutput | None = None
        prefilled_by = ""
        outcome = "abort"
        deadlines = self.deadline_policy.for_request(
            prepared.arrival, len(prepared.prompt_token_ids), prepared.sampling.max_tokens
        )
        if self.ratio_controller is not None:
            self.ratio_controller.note_prompt(len(prepared.prompt_token_ids))
        events = run_request(self.router, prepared.request_id, prepared.prompt_token_ids, prepared.sampling,
                             deadlines, prepared.block_hashes)
        try:
            async for event in events:
                prefill = event.prefill or prefill
                decode = event.decode or decode
                prefilled_by = event.prefilled_by or prefilled_by
                text = detokenizer.add(event.token_ids)
                finish = "stop" if detokenizer.is_stopped else event.finish_reason
                sent.extend(_token_times(event, time.time()))
                if event.num_migrations and event.finish_reason is not None:
                    self.metrics.migrations.inc(event.num_migrations)
                if finish is None:
                    yield TextDelta(text, event.token_ids, event.logprobs, None, len(sent))
                    continue
                text += detokenizer.flush()
                timings = stage_timings(prepared.arrival, admitted, sent, prefill, decode)
                if event.local_prefill_reason:
                    timings.prefill_on, timings.local_prefill_reason = "decode", event.local_prefill_reason
                timings.num_moves = event.num_migrations + event.num_moves
                num_prompt = len(prepared.prompt_token_ids)
                # The prefilling worker's count: the prefill pool's, or the decode worker's own prefill.
                cached = prefill.num_cached_tokens if prefill else decode.num_cached_tokens if decode else 0
                timings.cached_tokens = min(cached, num_prompt)
                outcome = finish
                self.metrics.observe_request(timings, finish, num_prompt, len(sent))
                if prefilled_by:
                    self.metrics.observe_prefix_cache(prefilled_by, num_prompt, timings.cached_tokens)
                self.recent.add(timings)
                yield TextDelta(text, event.token_ids, event.logprobs, finish, len(sent), timings,
                                timings.cached_tokens)
                return
        except RequestFailed as failed:
            outcome = "error"
            self.metrics.requests.labels("error").inc()
            self.metrics.request_errors.labels(failed.code).inc()
            raise
        finally:
            await events.aclose()  # aborts both workers unless the request finished there
            reservation.release()
            if outcome == "abort":
                self.metrics.requests.labels("abort").inc()

    def on_pool_change(self) -> None:
        """The set of active decode or mixed workers changed (failure, replacement, resize, role change):
        recompute capacity."""
        num_decoding = len(self.deployment.active(Role.DECODE, Role.MIXED))
        self.admission.set_capacity(self.max_request_tokens * num_decoding)


def _fast_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """tokenizer.encode, straight through the Rust tokenizer where that gives the same ids: transformers'
    encode() spends most of its time in Python (padding and truncation strategies) before getting there."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    probe = "Hello, world! Héllo wörld 🦊\n\n  <|im_start|> x"
    if backend is not None and backend.encode(probe).ids == list(tokenizer.encode(probe)):
        return lambda text: list(backend.encode(text).ids)
    return lambda text: list(tokenizer.encode(text))
