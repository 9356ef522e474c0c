"""(Over 300 lines: the five steps below run in order over one request; the rules of each step live in
the modules it names.)

Turns an OpenAI request into the request path's PreparedRequest.

prepare_completion() (one PreparedRequest per prompt of a batch) / prepare_chat():
    1. check the model name (none: the served one), that every field asks for something pdserve does
       (gateway/api/surface.py), token ids against the vocabulary, the sampling values, and vLLM's rules
       across its extensions (gateway/api/extensions.py);
    2. the grammar the output must follow: structured_outputs' or response_format's
       (gateway/api/structured.py), or a forced tool call's (gateway/api/tool_prompt.py);
    3. tokenize once (or render the chat template, with the tools and chat_template_kwargs), in a worker
       thread when the prompt or the conversation is long, so the event loop keeps streaming; keep the last
       truncate_prompt_tokens of it;
    4. check the context (prompt + max_tokens) against max_model_len (--max-model-len, else the model's),
       and prompt + n × max_tokens (the choices share the prompt's KV) against one decode worker's: HTTP 400
       in vLLM's words; a request that names no max_tokens gets what the context leaves (up to a default);
    5. hash the prompt's full blocks once (the router matches them against each worker's prefix cache).
Bad input raises BadRequest (HTTP 4xx with the parameter named).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from gateway.api.bad_request import BadRequest
from gateway.api.chat_render import render
from gateway.api.extensions import (
    bad_word_token_ids,
    check_common,
    output_grammar,
    prompt_logprobs_k,
    template_kwargs,
    truncated_prompt,
)
from gateway.api.protocol import MAX_LOGPROBS, ChatCompletionRequest, ChatMessage, CompletionRequest
from gateway.api.reasoning import ReasoningParser
from gateway.api.request_id import RequestId
from gateway.api.sampling_defaults import SamplingDefaults
from gateway.api.surface import MESSAGE_NOT_YET_SUPPORTED, check_fields
from gateway.api.tool_parsers import ToolCallParser, choose_parser
from gateway.api.tool_prompt import ToolPlan, plan_tools, template_messages
from gateway.requests.prepared import PreparedRequest
from llm_engine.config import ModelSpec
from llm_engine.kv_cache_manager import chain_root, prefix_hashes
from llm_engine.params import SamplingParams
from llm_engine.structured import GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
# A conversation of more messages than this is rendered in the worker thread whatever its length: the
# template's cost grows with the messages (empty ones too), not only with the characters.
LONG_CONVERSATION_MESSAGES = 32
COMPLETION_MAX_TOKENS = 16  # max_tokens of a completion that names none (OpenAI's default)
# prompt_logprobs: positions × (k + 1) entries, each a Python pair on the worker and an object in the response
# (~120 bytes): at k = 20 a 128k-token prompt was ~300 MB through both processes (review LOW).
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
T = TypeVar("T")


class Preparer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, spec: ModelSpec, model_name: str,
                 max_request_tokens: int, default_max_tokens: int | None, block_size: int,
                 tool_call_parser: str = "auto", reasoning_parser: ReasoningParser | None = None,
                 sampling_defaults: SamplingDefaults | None = None,
                 priority_scheduling: bool = False, max_logprobs: int = MAX_LOGPROBS) -> None:
        # default_max_tokens None: a chat request naming none gets the generation config's max_new_tokens,
        # else what the context leaves; sampling_defaults: --generation-config's (api/sampling_defaults.py).
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self.sampling_defaults = sampling_defaults or SamplingDefaults()
        self.priority_scheduling = priority_scheduling  # --scheduling-policy priority: else priority is 0
        self.max_logprobs = max_logprobs  # --max-logprobs: alternatives per token a request may ask for
        template = getattr(tokenizer, "chat_template", None)
        self.tool_parser: ToolCallParser = choose_parser(tool_call_parser, template)
        self.template_knows_tools = isinstance(template, str) and "tools" in template
        self.spec = spec
        self.model_name = model_name
        self.max_request_tokens = max_request_tokens  # KV one decode worker can hold for one request
        self.default_max_tokens = default_max_tokens
        self.block_size = block_size  # of the workers' KV cache: the prefix hashes are per block
        self._encode = _fast_encoder(tokenizer)
        # One thread: the tokenizer is not meant for concurrent use, and long prompts are rare.
        self._prompt_thread = ThreadPoolExecutor(1, thread_name_prefix="prompt-prep")

    async def _off_loop_if(self, is_long: bool, work: Callable[[], T]) -> T:
        if not is_long:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._prompt_thread, work)

    # Validation and tokenization.
    async def prepare_completion(self, request: CompletionRequest, request_id: RequestId | None = None
                                 ) -> list[PreparedRequest]:
        """One PreparedRequest per prompt (a batch is several), in prompt order."""
        request_id = request_id or RequestId.mint()
        self.check_model(request.model)
        check_fields(request.model_extra)
        check_common(request, self.spec.vocab_size)
        if request.stream and len(request.prompts) > 1:
            raise BadRequest("prompt: a batch of prompts with stream: true is not supported yet",
                             param="prompt", code="unsupported_field")
        if request.best_of is not None and request.best_of < request.n:
            raise BadRequest(f"best_of ({request.best_of}) must be at least n ({request.n})", param="best_of")
        if request.stream and request.num_sampled > request.n:  # the best are known only at the end
            raise BadRequest("best_of: cannot be more than n with stream: true", param="best_of",
                             code="unsupported_field")
        # A grammar is checked by the grammar engine (milliseconds for a large schema): off the event loop.
        grammar = await self._off_loop_if(has_grammar(request), lambda: output_grammar(request))
        prepared = []
        for index, item in enumerate(request.prompts):
            prompt = await self._prompt_tokens(item)
            if not prompt:
                raise BadRequest("the prompt is empty", param="prompt")
            prompt = truncated_prompt(prompt, request.truncate_prompt_tokens, self.spec.max_model_len)
            k = request.logprobs
            max_tokens = request.max_tokens
            if max_tokens is None:  # OpenAI's 16, within the context left (vLLM)
                max_tokens = self._room_for(prompt, COMPLETION_MAX_TOKENS)
            # max_tokens 0 scores the prompt only: the engine samples one token, which the response drops.
            one = self._prepare(request, prompt, max(1, max_tokens), k is not None, k or 0,
                                prompt_logprobs_k(request), grammar)
            one = replace(one, request_id=request_id.for_prompt(index, len(request.prompts)),
                          is_prompt_only=max_tokens == 0, batch_index=index)
            prepared.append(await self._hashed(one))
        return prepared

    async def _prompt_tokens(self, item: str | list[int]) -> list[int]:
        if isinstance(item, str):
            return await self.encode(item)
        vocab = self.spec.vocab_size
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"prompt token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                             param="prompt")
        return list(item)

    async def prepare_chat(self, request: ChatCompletionRequest, request_id: RequestId | None = None
                           ) -> PreparedRequest:
        self.check_model(request.model)
        check_fields(request.model_extra)
        for i, message in enumerate(request.messages):
            check_fields(message.model_extra, f"messages[{i}].", MESSAGE_NOT_YET_SUPPORTED)
        check_common(request, self.spec.vocab_size)
        if request.top_logprobs and not request.logprobs:
            raise BadRequest("top_logprobs: needs logprobs: true", param="top_logprobs")
        plan, grammar = await self._off_loop_if(
            has_grammar(request) or bool(request.tools),
            lambda: (plan_tools(request, self.tool_parser), output_grammar(request)))
        if grammar is not None and plan.grammar is not None:
            param = "structured_outputs" if request.structured_outputs is not None else "response_format"
            raise BadRequest(f"{param}: cannot be combined with a forced tool call (tool_choice "
                             "required or a named function)", param=param)
        prompt = await self.render_chat(request.messages, request.add_generation_prompt, plan,
                                        request.continue_final_message, template_kwargs(request))
        prompt = truncated_prompt(prompt, request.truncate_prompt_tokens, self.spec.max_model_len)
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:  # as vLLM: the generation config's max_new_tokens, else the context left
            max_tokens = self._room_for(prompt, self.default_max_tokens or self.sampling_defaults.max_tokens)
        prepared = self._prepare(request, prompt, max_tokens, request.logprobs, request.top_logprobs or 0,
                                 prompt_logprobs_k(request), grammar=grammar or plan.grammar)
        request_id = request_id or RequestId.mint()
        return await self._hashed(replace(prepared, request_id=request_id.for_prompt(0, 1),
                                          parses_tool_calls=plan.parser is not None))

    def _room_for(self, prompt: list[int], default: int | None) -> int:
        """max_tokens of a request that names none: `default` (None: no bound of its own), within the
        context the prompt leaves (as vLLM: max_model_len - prompt) and one decode worker's KV; at least 1,
        so that a prompt that fills the context alone is refused by name."""
        room = min(self.spec.max_model_len, self.max_request_tokens) - len(prompt)
        return max(1, room if default is None else min(default, room))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's token ids, as a completion's prompt is tokenized (in the worker thread when long);
        without the tokenizer's special tokens (e.g. BOS) when not add_special_tokens."""
        def encode() -> list[int]:
            if add_special_tokens:
                return self._encode(text)
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        return await self._off_loop_if(len(text) > LONG_PROMPT_CHARS, encode)

    async def decode(self, token_ids: list[int]) -> str:
        """The ids' text (in the worker thread when they are many)."""
        return await self._off_loop_if(len(token_ids) > LONG_PROMPT_TOKENS,
                                       lambda: str(self.tokenizer.decode(token_ids)))

    async def render_chat(self, request_messages: list[ChatMessage], add_generation_prompt: bool = True,
                          plan: ToolPlan | None = None, continue_final_message: bool = False,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The conversation's token ids through the model's chat template (with the plan's tools, and the
        request's chat_template_kwargs as more template variables)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BadRequest(f"model {self.model_name} has no chat template; use /v1/completions")
        tools = plan.tools if plan is not None else None
        messages = template_messages(request_messages, self.tool_parser, self.template_knows_tools, tools)
        is_long = (len(messages) > LONG_CONVERSATION_MESSAGES
                   or sum(len(m["content"]) for m in messages) > LONG_PROMPT_CHARS)
        # Only a template that knows tools gets them (the others have them in the system message).
        extra: dict[str, Any] = {"tools": tools} if tools and self.template_knows_tools else {}
        return await self._off_loop_if(is_long, lambda: render(
            self.tokenizer, messages, add_generation_prompt, continue_final_message, template_kwargs or {},
            extra))

    async def _hashed(self, prepared: PreparedRequest) -> PreparedRequest:
        """With the prompt's block hashes, which the router needs for every prefill pick."""
        prompt = prepared.prompt_token_ids
        root = chain_root(prepared.sampling.cache_salt)  # the routing belief is salted as the workers' cache
        hashes = await self._off_loop_if(len(prompt) > LONG_PROMPT_TOKENS,
                                         lambda: prefix_hashes(prompt, self.block_size, root))
        return replace(prepared, block_hashes=hashes)

    def check_model(self, name: str | None) -> None:
        """None (no `model` in the request) is the served model, as vLLM takes it."""
        if name is not None and name != self.model_name:
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
        top_logprobs: int = 0,
        prompt_logprobs: int | None = None,
        grammar: GrammarSpec | None = None,
    ) -> PreparedRequest:
        cap = self.sampling_defaults.max_tokens_cap  # --generation-config DIR's max_new_tokens (as vLLM)
        max_tokens = max_tokens if cap is None else min(max_tokens, cap)
        total = len(prompt) + max_tokens
        # vLLM's wording, which clients match on; param names what to shorten.
        source = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
        if total > self.spec.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.spec.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(prompt)} in the {source}, {max_tokens} in the completion). "
                f"Please reduce the length of the {source} or completion.",
                param=source if len(prompt) >= self.spec.max_model_len else "max_tokens",
                code="context_length_exceeded",
            )
        num_sampled = request.num_sampled
        # The choices decode on one worker, sharing the prompt.
        num_kv = len(prompt) + num_sampled * max_tokens
        if num_kv > self.max_request_tokens:
            completion = (f"{num_sampled} choices of {max_tokens} tokens" if num_sampled > 1
                          else f"{max_tokens}")
            too_many = "n" if num_sampled == request.n else "best_of"
            raise BadRequest(
                f"This request needs KV cache for {num_kv} tokens ({len(prompt)} in the {source}, "
                f"{completion} in the completion), but a decode worker holds at most "
                f"{self.max_request_tokens} tokens for one request. Please reduce the length of the {source} "
                "or completion.",
                param=(too_many if num_sampled > 1 and total <= self.max_request_tokens
                       else source if len(prompt) >= self.max_request_tokens else "max_tokens"),
                code="context_length_exceeded",
            )
        value = self.sampling_defaults.value  # the request's own, or the generation config's
        temperature, top_p = value(request, "temperature"), value(request, "top_p")
        is_greedy = temperature < MIN_TEMPERATURE or top_p < MIN_TOP_P
        for asked, param in ((top_logprobs, "logprobs" if isinstance(request, CompletionRequest)
                              else "top_logprobs"), (prompt_logprobs or 0, "prompt_logprobs")):
            if asked > self.max_logprobs:
                raise BadRequest(f"{param} asks for {asked} alternatives per token, more than this server "
                                 f"gives (--max-logprobs {self.max_logprobs})", param=param)
        if prompt_logprobs is not None and len(prompt) * (prompt_logprobs + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
            raise BadRequest(f"prompt_logprobs {prompt_logprobs} over a {len(prompt)}-token prompt is "
                             f"{len(prompt) * (prompt_logprobs + 1)} entries, more than one response carries "
                             f"({MAX_PROMPT_LOGPROB_ENTRIES}): ask for fewer alternatives or a shorter "
                             "prompt",
                             param="prompt_logprobs")
        if request.priority and not self.priority_scheduling:  # vLLM's rule: a priority that would not count
            raise BadRequest(f"priority {request.priority} needs priority scheduling, and this server admits "
                             "requests in arrival order (--scheduling-policy fcfs)", param="priority")
        if request.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})",
                             param="min_tokens")
        try:
            sampling = SamplingParams(
                max_tokens=max_tokens,
                temperature=0.0 if is_greedy else temperature,
                top_p=top_p,
                top_k=max(0, value(request, "top_k") or 0),
                min_p=value(request, "min_p") or 0.0,
                bad_words=bad_word_token_ids(self.tokenizer, request.bad_words),
                allowed_token_ids=tuple(request.allowed_token_ids) if request.allowed_token_ids else None,
                seed=request.seed,
                ignore_eos=request.ignore_eos,
                # best_of ranks the choices by their tokens' logprobs, shown or not.
                logprobs=logprobs or num_sampled > request.n,
                top_logprobs=top_logprobs,
                prompt_logprobs=prompt_logprobs,
                presence_penalty=value(request, "presence_penalty"),
                frequency_penalty=value(request, "frequency_penalty"),
                repetition_penalty=value(request, "repetition_penalty"),
                logit_bias=request.logit_bias_pairs,
                min_tokens=request.min_tokens,
                stop_token_ids=self._stop_token_ids(request, grammar),
                n=num_sampled,
                grammar=grammar,
                cache_salt=request.cache_salt,
            )
        except ValueError as error:
            raise BadRequest(str(error)) from None
        return PreparedRequest(
            f"req-{uuid.uuid4().hex}", tuple(prompt), sampling, request.stop_strings, time.time(),
            priority=request.priority, skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )

    def _stop_token_ids(self, request: CompletionRequest | ChatCompletionRequest, grammar: GrammarSpec | None
                        ) -> tuple[int, ...]:
        stop = tuple(request.stop_token_ids or ())
        # A grammar ends on EOS; a model whose config names none ends on its tokenizer's, named here.
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if grammar is not None and not self.spec.eos_token_ids and isinstance(eos, int) and eos not in stop:
            stop = (*stop, eos)
        return stop


def _fast_encoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[str], list[int]]:
    """tokenizer.encode, straight through the Rust tokenizer where that gives the same ids: transformers'
    encode() spends most of its time in Python (padding and truncation strategies) before getting there."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    probe = "Hello, world! Héllo wörld 🦊\n\n  <|im_start|> x"
    if backend is not None and backend.encode(probe).ids == list(tokenizer.encode(probe)):
        return lambda text: list(backend.encode(text).ids)
    return lambda text: list(tokenizer.encode(text))


def has_grammar(request: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether the request's output follows a grammar the engine must check (structured outputs, or a
    response_format other than text)."""
    return request.structured_outputs is not None or (
        request.response_format is not None and request.response_format.type != "text")
