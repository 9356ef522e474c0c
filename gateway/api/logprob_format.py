"""Logprobs in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes, top_logprobs) and the
legacy completions' parallel lists (tokens, token_logprobs, top_logprobs, text_offset), the echoed prompt's
first when asked.

A token is shown as its own text, decoded alone ("the" with its leading space, not the BPE piece "Ġthe"); a
token that holds only part of a UTF-8 character decodes to U+FFFD, and `bytes` then are those of the text, as
vLLM gives them. Texts are cached per token id (at most the vocabulary). With vLLM's
return_tokens_as_token_ids a token is named "token_id:<id>" instead (TokenIdTexts), wherever its text
would be.
vLLM's `prompt_logprobs` have a shape of their own (vllm_prompt_logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from gateway.api.protocol import CompletionLogprobs, TokenLogprob, TopLogprob
from gateway.api.protocol_extensions import PromptLogprob
from llm_engine.params import PromptLogprobs, TopLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenTexts:
    """Each token's text, decoded alone; one decode per token id for the server's life."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # bounded by the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self._tokenizer.decode([token_id]))
        return text


class TokenIdTexts(TokenTexts):
    """return_tokens_as_token_ids: every token is named by its id (text that always round-trips)."""

    def __init__(self) -> None:
        pass

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def vllm_prompt_logprobs(texts: TokenTexts, prompt_token_ids: Sequence[int], scored: PromptLogprobs | None,
                         k: int) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: None for the first position, then for each prompt token a map from token id to
    its logprob, rank and text: the prompt's own token, and the k most likely there (rank 1..k)."""
    if scored is None:
        return None
    entries: list[dict[str, PromptLogprob] | None] = [None]
    for position, token in enumerate(prompt_token_ids[1:]):
        rank = scored.ranks[position] if position < len(scored.ranks) else 0
        entry = {str(token): PromptLogprob(logprob=scored.logprobs[position], rank=rank,
                                           decoded_token=texts(token))}
        for i, (t, lp) in enumerate(scored.top[position][:k]):
            entry.setdefault(str(t), PromptLogprob(logprob=lp, rank=i + 1, decoded_token=texts(t)))
        entries.append(entry)
    return entries


def _top(texts: TokenTexts, top: TopLogprobs) -> list[TopLogprob]:
    return [TopLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode())) for t, lp in top]


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs]) -> list[TokenLogprob]:
    """One entry per generated token (tops may be empty: top_logprobs 0)."""
    return [
        TokenLogprob(token=texts(t), logprob=lp, bytes=list(texts(t).encode()),
                     top_logprobs=_top(texts, tops[i]) if i < len(tops) else [])
        for i, (t, lp) in enumerate(zip(token_ids, logprobs, strict=False))
    ]


class CompletionLogprobsBuilder:
    """One choice's completions logprobs, built delta by delta (text_offset runs over the whole choice)."""

    def __init__(self, texts: TokenTexts, k: int, offset: int = 0) -> None:
        self.texts = texts
        self.k = k  # alternatives asked for: top_logprobs entries are null when 0
        self.offset = offset  # where the next token's text starts in the choice's text

    def _entries(self, token_ids: Sequence[int], logprobs: list[float | None],
                 tops: list[TopLogprobs | None]) -> CompletionLogprobs:
        tokens, offsets = [], []
        for t in token_ids:
            text = self.texts(t)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
        top_maps: list[dict[str, float] | None] = [
            # [: k]: the prompt may be scored for more (vLLM's prompt_logprobs asked for more than logprobs).
            None if top is None else {self.texts(t): lp for t, lp in top[: self.k]} for top in tops
        ]
        return CompletionLogprobs(tokens=tokens, token_logprobs=logprobs,
                                  top_logprobs=top_maps if self.k else None, text_offset=offsets)

    def prompt(self, prompt_token_ids: tuple[int, ...], scored: PromptLogprobs | None) -> CompletionLogprobs:
        """The echoed prompt's entries: the first token has no logprob (nothing before it)."""
        logprobs: list[float | None] = [None, *(scored.logprobs if scored else ())]
        tops: list[TopLogprobs | None] = [None, *(scored.top if scored else ())]
        return self._entries(prompt_token_ids, logprobs, tops)

    def generated(self, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[TopLogprobs]) -> CompletionLogprobs:
        return self._entries(token_ids, list(logprobs), [tops[i] if i < len(tops) else ()
                                                          for i in range(len(token_ids))])


def joined(*parts: CompletionLogprobs) -> CompletionLogprobs:
    top = [entry for part in parts for entry in (part.top_logprobs or [])]
    return CompletionLogprobs(
        tokens=[t for part in parts for t in part.tokens],
        token_logprobs=[lp for part in parts for lp in part.token_logprobs],
        top_logprobs=top if any(part.top_logprobs is not None for part in parts) else None,
        text_offset=[o for part in parts for o in part.text_offset],
    )
