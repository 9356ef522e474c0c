"""Logits processors that forbid tokens outright: allowed_token_ids (only these) and bad_words (never these
sequences), vLLM's two request extensions of that kind (llm_engine/logits_processors.py runs them).

Like every processor, their state derives from the request's own tokens only (TokenHistory at register, the
sampled tokens at record), so the prefill worker, the decode worker and a worker a request migrates to all
forbid the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llm_engine.batch import TokenHistory
from llm_engine.logits_processors import LogitsProcessor, SamplingRows
from llm_engine.params import SamplingParams


class AllowedTokens(LogitsProcessor):
    """Every token outside a row's allowed_token_ids goes to -inf (stateless)."""

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        restricted = [(row, p.allowed_token_ids) for row, p in enumerate(rows.params)
                      if p.allowed_token_ids is not None]
        if not restricted:
            return
        vocab = logits.shape[-1]
        keep = torch.zeros(len(restricted), vocab, dtype=torch.bool, device=logits.device)  # [A, V]
        for i, (_, allowed) in enumerate(restricted):
            keep[i, [t for t in allowed if t < vocab]] = True
        row_ids = [row for row, _ in restricted]
        logits[row_ids] = logits[row_ids].masked_fill(~keep, float("-inf"))


class BadWords(LogitsProcessor):
    """A bad word's last token is forbidden where the output so far ends with the word's other tokens (a
    one-token word: always), as vLLM applies bad_words: over the generated tokens only, not the prompt.
    State per request with a word of several tokens: the output's last (longest word - 1) tokens."""

    def __init__(self) -> None:
        self._tails: dict[str, list[int]] = {}  # request id → the output's last tokens, ≤ longest word - 1

    @staticmethod
    def _tail_length(params: SamplingParams) -> int:
        return max((len(word) for word in params.bad_words), default=1) - 1

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        self._tails.pop(request_id, None)
        keep = self._tail_length(params)
        if keep > 0:
            outputs = history.output_token_ids
            self._tails[request_id] = list(outputs[max(0, len(outputs) - keep):])

    def record(self, rows: SamplingRows, token_ids: torch.Tensor) -> None:
        if not self._tails:
            return
        chosen = token_ids.tolist()
        for row, request_id in enumerate(rows.request_ids):
            tail = self._tails.get(request_id)
            if tail is not None:
                tail.append(chosen[row])
                del tail[: len(tail) - self._tail_length(rows.params[row])]

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._tails.pop(request_id, None)

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        cells: list[tuple[int, int]] = []
        for row, (request_id, params) in enumerate(zip(rows.request_ids, rows.params, strict=True)):
            if not params.bad_words:
                continue
            tail = self._tails.get(request_id, [])
            for word in params.bad_words:
                prefix = list(word[:-1])
                if not prefix or (len(tail) >= len(prefix) and tail[len(tail) - len(prefix):] == prefix):
                    cells.append((row, word[-1]))
        vocab = logits.shape[-1]
        cells = [(row, token) for row, token in cells if token < vocab]
        if cells:
            row_ids, token_ids = zip(*cells, strict=True)
            logits[list(row_ids), list(token_ids)] = float("-inf")
