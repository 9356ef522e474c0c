"""The structured-output logits processor: each request with a grammar (SamplingParams.grammar) has a
matcher that masks every token the grammar cannot take next, so the output is the grammar's text and ends
where the grammar ends (the matcher then allows only EOS).

    register(history) → a copy of the cached compiled matcher (llm_engine/structured.py), fed the
                        request's output tokens so far
                        (a new request: none; on a decode worker: the prefill worker's first token; after a
                        migration or a preemption: everything generated before), so any worker rebuilds the
                        same state from the tokens alone;
    apply(logits)     → fill the bitmask rows of the requests with a grammar, set what they forbid to -inf;
    record(tokens)    → each chosen token advances its matcher;
    forget            → the table left the runner: drop the matcher.
A token the matcher refuses (only possible when another processor forced every allowed token to -inf, e.g.
min_tokens holding back the EOS the grammar requires) ends masking for that request, with a warning: the
request still ends (max_tokens) instead of failing the worker's step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from llm_engine.batch import TokenHistory
from llm_engine.logits_processors import LogitsProcessor, SamplingRows
from llm_engine.params import SamplingParams
from llm_engine.structured import GrammarCache

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)


class GrammarMask(LogitsProcessor):
    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown as batches need
        self.mask_seconds = 0.0  # time spent filling and applying masks (the structured-output cost)
        self.num_masked_rows = 0  # rows masked (mask_seconds / this = per-row cost)
        self.num_masked_steps = 0  # forwards that masked any row (mask_seconds / this = per-step cost)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        self._matchers.pop(request_id, None)
        if params.grammar is None:
            return
        matcher = self.cache.matcher(params.grammar)
        for index, token in enumerate(history.output_token_ids):
            if not matcher.consume_token(token):
                logger.warning("request %s: output token %d (%d) does not fit its grammar; not masking it",
                               request_id, index, token)
                return
        self._matchers[request_id] = matcher

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def record(self, rows: SamplingRows, token_ids: torch.Tensor) -> None:
        if not self._matchers:
            return
        chosen = token_ids.tolist()
        for row, request_id in enumerate(rows.request_ids):
            matcher = self._matchers.get(request_id)
            if matcher is None:
                continue
            if not matcher.consume_token(chosen[row]):
                logger.warning("request %s: token %d does not fit its grammar (another processor removed "
                               "every token it allows); not masking it any more", request_id, chosen[row])
                del self._matchers[request_id]

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        # logits: [S, V]
        if not self._matchers:
            return
        masked = [(row, m) for row, r in enumerate(rows.request_ids)
                  if (m := self._matchers.get(r)) is not None]
        if not masked:
            return
        import llguidance.torch

        started = time.perf_counter()
        vocab_size = logits.shape[-1]
        if self._bitmask is None or self._bitmask.shape[0] < len(masked):
            self._bitmask = llguidance.torch.allocate_token_bitmask(max(len(masked), 8), vocab_size)
        for i, (_, matcher) in enumerate(masked):
            llguidance.torch.fill_next_token_bitmask(matcher, self._bitmask, i)
        index = torch.tensor([row for row, _ in masked], device=logits.device)
        selected = logits[index]  # [M, V], a copy
        llguidance.torch.apply_token_bitmask_inplace(selected, self._bitmask[: len(masked)].to(logits.device))
        logits[index] = selected
        self.mask_seconds += time.perf_counter() - started
        self.num_masked_rows += len(masked)
        self.num_masked_steps += 1
