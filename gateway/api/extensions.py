"""vLLM's request extensions turned into what the request path needs (gateway/api/prepare.py calls these):
bad words as token sequences, the prompt truncated, the chat template's extra arguments, the grammar of
`structured_outputs` or `response_format`, and the checks vLLM makes across fields. Bad input raises
BadRequest naming the field.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gateway.api.bad_request import BadRequest
from gateway.api.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.structured import response_format_grammar, structured_outputs_grammar
from llm_engine.structured import GrammarSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Arguments of apply_chat_template that the request sets through its own fields, or that would change what
# the call returns: chat_template_kwargs may not name them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "raise_exception", "strftime_now",  # functions transformers gives every template
})


def bad_word_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str] | None
                       ) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token sequences, as vLLM tokenizes them: the word (leading blanks dropped) alone, and
    with one leading space (the same word in the middle of a text) when that is another sequence of as many
    tokens (a tokenizer that splits the space off into a token of its own would only add a space token)."""
    sequences: list[tuple[int, ...]] = []
    for word in words or []:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not bare:
            raise BadRequest(f"bad_words: {word!r} has no tokens", param="bad_words")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced):
            if ids not in sequences and (ids is bare or (len(ids) == len(bare) and ids[0] != bare[0])):
                sequences.append(ids)
    return tuple(sequences)


def truncated_prompt(prompt: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """The prompt's last `truncate_prompt_tokens` tokens (-1: the context's worth), as vLLM truncates (on the
    left, so the end of the prompt, nearest the answer, stays)."""
    if truncate_prompt_tokens is None:
        return prompt
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep > max_model_len:
        raise BadRequest(f"truncate_prompt_tokens ({keep}) cannot be greater than max_model_len "
                         f"({max_model_len}); use a smaller value", param="truncate_prompt_tokens")
    if keep == 0:
        raise BadRequest("truncate_prompt_tokens: 0 would leave no prompt", param="truncate_prompt_tokens")
    return prompt[-keep:]


def check_common(request: CompletionRequest | ChatCompletionRequest, vocab_size: int) -> None:
    """Checks that hold for both endpoints: token ids within the vocabulary, and vLLM's rules."""
    if request.stream and request.prompt_logprobs is not None:
        raise BadRequest("prompt_logprobs: not available with stream: true (as on vLLM)",
                         param="prompt_logprobs")
    for name, ids in (("logit_bias", [t for t, _ in request.logit_bias_pairs]),
                      ("stop_token_ids", request.stop_token_ids or []),
                      ("allowed_token_ids", request.allowed_token_ids or [])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise BadRequest(f"{name}: token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
                             param=name)
    options = request.stream_options
    if options is not None and options.continuous_usage_stats and not options.include_usage:
        raise BadRequest("stream_options.continuous_usage_stats: needs include_usage: true",
                         param="stream_options.continuous_usage_stats")


def output_grammar(request: CompletionRequest | ChatCompletionRequest) -> GrammarSpec | None:
    """The grammar of `structured_outputs` or `response_format` (never both)."""
    structured = structured_outputs_grammar(request.structured_outputs)
    formatted = response_format_grammar(request.response_format)
    if structured is not None and formatted is not None:
        raise BadRequest("structured_outputs: cannot be combined with response_format",
                         param="structured_outputs")
    return structured or formatted


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's extra variables (chat_template_kwargs); a reserved name is a 400 naming it."""
    kwargs = request.chat_template_kwargs or {}
    for name in kwargs:
        if name in RESERVED_TEMPLATE_KWARGS:
            param = f"chat_template_kwargs.{name}"
            raise BadRequest(f"{param}: set by the request itself, not a template variable", param=param)
    if request.continue_final_message and request.add_generation_prompt:
        raise BadRequest("continue_final_message and add_generation_prompt cannot both be true (set "
                         "add_generation_prompt: false to continue the last message)",
                         param="continue_final_message")
    return kwargs


def prompt_logprobs_k(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """Alternatives to score at each prompt position: vLLM's prompt_logprobs, and completions' echo with
    logprobs (whichever asks for more; each answer shows its own number)."""
    asked = [request.prompt_logprobs]
    if isinstance(request, CompletionRequest) and request.echo and request.logprobs is not None:
        asked.append(request.logprobs)
    ks = [k for k in asked if k is not None]
    return max(ks) if ks else None


def echoed_message(request: ChatCompletionRequest) -> str:
    """Chat `echo`: the text the answer starts with: the last message's, when it has the answer's role (the
    assistant's with add_generation_prompt, else the last message's own: vLLM's rule)."""
    if not request.echo:
        return ""
    last = request.messages[-1]
    role = "assistant" if request.add_generation_prompt else last.role
    return last.text if last.role == role else ""
