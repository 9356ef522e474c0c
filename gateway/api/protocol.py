"""(Over 300 lines: every model of the OpenAI surface, so that request and response shapes read side by side
as OpenAI's own reference lists them; vLLM's extensions are in protocol_extensions.py.)

The HTTP edge: OpenAI-compatible request and response models (pydantic), validated once, here."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from gateway.api.protocol_extensions import (
    PromptLogprobsField,
    VllmChatFields,
    VllmSamplingFields,
)
from gateway.api.protocol_tools import (
    TOOLS_FIELD,
    ResponseFormat,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolList,
)
from gateway.telemetry.timings import Timings
from llm_engine.choices import MAX_CHOICES

MAX_STOP_STRINGS = 16  # OpenAI takes 4; a few more cost little (each is searched for after every token)
MAX_STOP_CHARS = 256  # per stop string: text that could start one is held back from the stream
# The chat template is rendered per message (~15 µs each): a 4 MiB body holds ~130k empty ones, seconds of
# rendering before the context check could refuse the request. Real conversations stay far below this.
MAX_MESSAGES = 2048
MAX_LOGPROBS = 20  # top_logprobs / completions logprobs, as OpenAI's top_logprobs (the engine's bound too)
MAX_LOGIT_BIAS = 1024  # entries; each costs one scatter per step
# Of a logit_bias key: any vocabulary's ids have fewer, and int() refuses keys of more than 4300 digits.
MAX_TOKEN_ID_DIGITS = 10
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 64  # prompts in one completions batch


def _encodable(text: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\ud800"), which is no character: the tokenizer cannot take it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]  # text that reaches the tokenizer
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]


class _Request(VllmSamplingFields):
    # Undeclared fields are kept for gateway/api/surface.py, which refuses (400, naming them) every one whose
    # effect pdserve cannot honour. Types are strict, as OpenAI's are: "5" is not a number nor 1 a boolean;
    # wrong types and ranges are 400s. vLLM's extensions are declared in gateway/api/protocol_extensions.py.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None: the served model (as vLLM)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, lt=2**31)  # extension; None, 0 or -1 disable it
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # 64 bits, signed or not, as vLLM takes
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)
    ] | None = None
    # Choices of one prompt: one prefill, their first tokens drawn from the same logits (each with its own
    # seed derived from `seed`), then decoded from the prompt's KV, shared on one decode worker.
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)  # extension (vLLM's)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id → bias
    min_tokens: int = Field(default=0, ge=0)  # extension: EOS and stop_token_ids wait for this many tokens
    stop_token_ids: TokenIds | None = None  # extension: tokens that end generation (as EOS does)
    # Accepted and ignored by design: they change nothing in what the model generates.
    user: str | None = None  # an end-user id for the caller's abuse monitoring
    metadata: dict[str, Any] | None = None  # the caller's tags (OpenAI stores them with `store`)
    store: bool | None = None  # OpenAI keeps completions for its dashboard; pdserve keeps none
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate exactly max_tokens (benchmarks)
    return_token_ids: bool = False  # extension: the choice carries the generated token ids
    # text (default), json_object or json_schema: the output is held to a grammar (gateway/api/structured.py)
    response_format: ResponseFormat | None = None

    @field_validator("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "best_of", "logprobs",
                     "top_logprobs", "min_tokens", "prompt_logprobs", "truncate_prompt_tokens", "priority",
                     mode="before", check_fields=False)
    @classmethod
    def _whole_number(cls, value: object) -> object:
        # JSON has one number type: 4.0 is an integer to JSON Schema (and what some clients send for 4).
        # Otherwise integers are strict: "4", 4.5 and true are refused.
        return int(value) if isinstance(value, float) and value.is_integer() else value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is None:
            return None
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries are allowed, got {len(bias)}")
        bad = [key for key in bias
               if not key.isascii() or not key.isdigit() or len(key) > MAX_TOKEN_ID_DIGITS]
        if bad:
            shown = bad[0] if len(bad[0]) <= 20 else f"{bad[0][:20]}..."  # not 5000 digits back
            raise ValueError(f"keys must be token ids (non-negative integers as strings, at most "
                             f"{MAX_TOKEN_ID_DIGITS} digits), got {shown!r}")
        return bias

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(key), float(bias)) for key, bias in (self.logit_bias or {}).items())

    @field_validator("stop", mode="before")
    @classmethod
    def _few_stop_strings(cls, stop: object) -> object:
        # Refused before its items are validated: 10^5 stop strings cost nothing to turn away.
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stop)}")
        return stop

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stops if s]  # "" would stop every request before its first character

    @property
    def num_sampled(self) -> int:
        """Choices the engine generates (completions' best_of may ask for more than the n returned)."""
        return self.n


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


PromptText = Annotated[str, Field(min_length=1), AfterValidator(_encodable)]
PromptIds = Annotated[list[int], Field(min_length=1)]
PromptTexts = Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)]
PromptIdLists = Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]


class CompletionRequest(_Request):
    # Text, or token ids; or a batch of either (one choice per prompt, `index` in prompt order).
    prompt: PromptText | PromptIds | PromptTexts | PromptIdLists
    max_tokens: int | None = Field(default=None, ge=0)  # 0: score the prompt only (with echo and logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # the chosen token's + k alternatives
    echo: bool = False  # the prompt comes back before the completion (with its logprobs when asked)
    # Choices generated (≥ n, not streamed when more): the n with the highest cumulative logprob come back.
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)

    @property
    def num_sampled(self) -> int:
        """best_of's choices, of which the response keeps n (best_of < n is refused at preparation)."""
        return max(self.n, self.best_of or 1)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: one prompt per choice."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        return list(prompt)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    # Undeclared fields are kept for gateway/api/surface.py (it names each one it refuses).
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None  # None only on an assistant message with tool_calls
    name: str | None = None  # a participant's name: accepted, not given to the chat template
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls (gateway/api/tool_prompt.py)
    tool_call_id: str | None = None  # a tool message: the call it answers
    # An assistant message's thinking as a reasoning parser returned it (clients send it back in a history):
    # given to the template as both names (Qwen3's reads reasoning_content; most ignore it).
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: Text


class ChatCompletionRequest(_Request, VllmChatFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    tools: ToolList | None = TOOLS_FIELD  # functions the model may call (rendered by the chat template)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # accepted; a forced call (required / named) is one call


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from a prefix cache (not recomputed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # present when some prompt tokens were cached


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token (echoed prompt first)."""

    tokens: list[str]  # each token's text (decoded alone)
    token_logprobs: list[float | None]  # None for the prompt's first token (no context)
    top_logprobs: list[dict[str, float] | None] | None = None  # text → logprob of the k most likely (k > 0)
    text_offset: list[int]  # where each token's text starts in the choice's text


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, when the request asked for prompt_logprobs


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    timings: Timings | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    # With --reasoning-parser: the model's thinking, under vLLM's name and its older one (clients read one).
    reasoning: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] | list[ToolCallDelta] | None = None  # whole calls, or a stream's pieces


class TopLogprob(BaseModel):
    token: str  # the token's text (decoded alone)
    logprob: float
    bytes: list[int] | None  # its UTF-8 bytes (a token may hold part of a character)


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the top_logprobs most likely tokens at this position


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatDelta | None = None
    delta: ChatDelta | None = None
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    timings: Timings | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's, when the request asked for prompt_logprobs


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


_Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
ChatMessage.model_rebuild()
