"""The structured-output logits processor: each request with a grammar (SamplingParams.grammar) has a
matcher that masks every token the grammar cannot take next, so the output is the grammar's text and ends
where the grammar ends (the matcher then allows only EOS, and accepting EOS terminates it).

    register(history) → a matcher from the cached compiled grammar (ending on EOS or one of the request's
                        stop tokens), fed the request's output tokens so far
                        (a new request: none; on a decode worker: the prefill worker's first token; after a
                        migration or a preemption: everything generated before), so any worker rebuilds the
                        same state from the tokens alone;
    apply(logits)     → fill the bitmask rows of the requests still matching, set the rest to -inf;
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
from llm_engine.sampling import SamplingParams
from llm_engine.structured import GrammarCache

if TYPE_CHECKING:
    import xgrammar

logger = logging.getLogger(__name__)


class GrammarMask(LogitsProcessor):
    def __init__(self, cache: GrammarCache) -> None:
        self.cache = cache
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown as batches need
        self.mask_seconds = 0.0  # time spent filling and applying masks (the structured-output cost)
        self.num_masked_rows = 0  # rows masked (mask_seconds / this = per-row cost)

    @property
    def num_matchers(self) -> int:
        return len(self._matchers)

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        self._matchers.pop(request_id, None)
        if params.grammar is None:
            return
        import xgrammar as xgr

        # The grammar ends on a token that ends the request: the model's EOS or the request's stop tokens (the
        # gateway adds the tokenizer's EOS there for a model whose config names none).
        stop_tokens = [*self.cache.stop_token_ids, *params.stop_token_ids] or None
        matcher = xgr.GrammarMatcher(self.cache.compiled(params.grammar), override_stop_tokens=stop_tokens)
        for index, token in enumerate(history.output_token_ids):
            if not matcher.accept_token(token):
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
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(chosen[row]):
                logger.warning("request %s: token %d does not fit its grammar (another processor removed "
                               "every token it allows); not masking it any more", request_id, chosen[row])
                del self._matchers[request_id]

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        # logits: [S, V]
        if not self._matchers:
            return
        masked = [(row, m) for row, r in enumerate(rows.request_ids)
                  if (m := self._matchers.get(r)) is not None and not m.is_terminated()]
        if not masked:
            return
        import xgrammar as xgr

        started = time.perf_counter()
        vocab_size = logits.shape[-1]
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(max(logits.shape[0], 8), vocab_size)
        for row, matcher in masked:
            matcher.fill_next_token_bitmask(self._bitmask, row)
        xgr.apply_token_bitmask_inplace(logits, self._bitmask[: logits.shape[0]].to(logits.device),
                                        vocab_size=vocab_size, indices=[row for row, _ in masked])
        self.mask_seconds += time.perf_counter() - started
        self.num_masked_rows += len(masked)
