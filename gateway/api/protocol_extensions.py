"""vLLM's request extensions at the HTTP edge: the fields a vLLM client sends beyond OpenAI's (often through
the openai SDK's `extra_body`), with vLLM's names, defaults and ranges. Each is applied
(gateway/api/prepare.py and extensions.py, the engine's sampler, the gateway's detokenizer and framing);
docs/api.md's "Request fields" says how.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

MAX_BAD_WORDS = 64  # each bad word costs a comparison per step
MAX_BAD_WORD_CHARS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # more than any vocabulary: a list of every id is a valid (useless) request
MAX_PROMPT_LOGPROBS = 20  # as vLLM's default max_logprobs (and the engine's bound)
MAX_CHOICE_STRINGS = 1024  # structured_outputs.choice
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex or grammar's text (as a JSON schema's)
MAX_CACHE_SALT_CHARS = 1024  # a tenant's or a user's id, or a secret drawn per tenant


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (which replaced its guided_* fields): exactly one of json, json_object,
    regex, choice and grammar; the output is held to it by the grammar engine (llguidance)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    # `json` would shadow BaseModel.json(): the attribute is json_schema, the JSON key `json`.
    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")  # a schema, or its JSON text
    json_object: bool | None = None  # true: any JSON object
    regex: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None  # Rust `regex` syntax
    # The output is one of these strings.
    choice: Annotated[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]],
                      Field(min_length=1, max_length=MAX_CHOICE_STRINGS)] | None = None
    grammar: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None  # Lark, or GBNF (llama.cpp's)
    # vLLM's options. pdserve has one grammar engine and never falls back: disable_fallback holds either way.
    disable_fallback: bool = False
    # JSON is written with fixed separators and no free whitespace whatever this says: a stricter subset
    # of what false allows, exactly what true asks.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # true: objects take no property their schema does not name
    whitespace_pattern: str | None = None  # refused unless null (gateway/api/structured.py)
    structural_tag: str | None = None  # refused unless null: no structural tags (tool-call tagging) yet


class VllmSamplingFields(BaseModel):
    """vLLM's extensions on both endpoints (completions and chat). Defaults are vLLM's: each asks for
    nothing there."""

    # Drop tokens less likely than min_p × the most likely one (after temperature); None or 0: keep all.
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # Text the output never contains: each is tokenized as written and with a leading space.
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    # Only these token ids may be generated.
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]],
                                 Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    # Each prompt token's logprob (and the k most likely at each position): vLLM's `prompt_logprobs`.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS)
    # Keep only the prompt's last k tokens (-1: as many as the context takes), as vLLM truncates (left).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    skip_special_tokens: bool = True  # special tokens (e.g. EOS, <|im_end|>) are left out of the text
    include_stop_str_in_output: bool = False  # the stop string (or stop token's text) ends the text
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>", not their text
    structured_outputs: StructuredOutputs | None = None
    # Admission order when requests wait for KV capacity: lower first, then arrival (vLLM's priority);
    # refused unless the server runs --scheduling-policy priority.
    priority: int = Field(default=0, ge=-(2**63), lt=2**63)
    # The request's prefix-cache partition (vLLM's cache_salt): only requests with the same salt share cached
    # KV, so one tenant cannot learn from timing or counts whether another's prompt is cached.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)


class VllmChatFields(BaseModel):
    """vLLM's extensions on /v1/chat/completions: how the conversation is rendered, and `echo`."""

    add_generation_prompt: bool = True  # the template opens the assistant's turn after the messages
    continue_final_message: bool = False  # the last message stays open: the model continues its text
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template
    echo: bool = False  # the answer starts with the last message's content when it has the answer's role


class PromptLogprob(BaseModel):
    """One token's entry in vLLM's `prompt_logprobs` (a map from token id to these, per prompt position)."""

    logprob: float
    rank: int  # 1: the most likely token at its position
    decoded_token: str  # its text decoded alone ("token_id:<id>" with return_tokens_as_token_ids)


# Per prompt position: None for the first (nothing before it), else the prompt's token and the k most likely,
# keyed by token id (a JSON object's keys are strings).
PromptLogprobsField = list[dict[str, PromptLogprob] | None] | None
