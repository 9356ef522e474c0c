"""The HTTP edge: OpenAI-compatible request and response models (pydantic), validated once, here."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from gateway.telemetry.timings import Timings

MAX_STOP_STRINGS = 16  # OpenAI takes 4; a few more cost little (each is searched for after every token)
MAX_STOP_CHARS = 256  # per stop string: text that could start one is held back from the stream
# The chat template is rendered per message (~15 µs each): a 4 MiB body holds ~130k empty ones, seconds of
# rendering before the context check could refuse the request. Real conversations stay far below this.
MAX_MESSAGES = 2048


def _encodable(text: str) -> str:
    # JSON can spell a lone UTF-16 surrogate ("\ud800"), which is no character: the tokenizer cannot take it.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text (a lone surrogate at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]  # text that reaches the tokenizer


class _Request(BaseModel):
    # Unknown fields are ignored (OpenAI clients send many). Types are strict, as OpenAI's are: "5" is not a
    # number nor 1 a boolean; wrong types and ranges are 400s.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=2**31)  # extension; 0 or -1 disable it
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # 64 bits, signed or not, as vLLM takes
    stop: Annotated[str, Field(max_length=MAX_STOP_CHARS)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)
    ] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension: generate exactly max_tokens (benchmarks)
    return_token_ids: bool = False  # extension: the choice carries the generated token ids

    @field_validator("max_tokens", "max_completion_tokens", "top_k", "seed", "n", "logprobs", "top_logprobs",
                     mode="before", check_fields=False)
    @classmethod
    def _whole_number(cls, value: object) -> object:
        # JSON has one number type: 4.0 is an integer to JSON Schema (and what some clients send for 4).
        # Otherwise integers are strict: "4", 4.5 and true are refused.
        return int(value) if isinstance(value, float) and value.is_integer() else value

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


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class CompletionRequest(_Request):
    # Text, or token ids.
    prompt: Annotated[str, Field(min_length=1), AfterValidator(_encodable)] | Annotated[
        list[int], Field(min_length=1)
    ]
    logprobs: int | None = Field(default=None, ge=0, le=0)  # only the chosen token's logprob


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=0)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served from a prefix cache (not recomputed)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # present when some prompt tokens were cached


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None
    logprobs: dict[str, list[float | str]] | None = None
    token_ids: list[int] | None = None


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
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatDelta | None = None
    delta: ChatDelta | None = None
    finish_reason: str | None
    logprobs: dict[str, list[dict[str, float | str]]] | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    timings: Timings | None = None


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
