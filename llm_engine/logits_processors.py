"""What changes a batch's next-token logits before a token is chosen: logit_bias, min_tokens and the
penalties over the tokens so far, each one vectorised step over the rows that sample this forward.

    ModelRunner.execute:  forget(finished) → register(chunks carrying a TokenHistory)
        → apply(raw logits [S, V]) = LogitBias → MinTokens → Penalties → the runner's extras (the grammar's
          token mask, llm_engine/grammar_mask.py)
        → choose tokens → record(the sampled tokens).

Sampling must not depend on which worker samples: the prefill worker draws token 0, a decode worker the rest,
and after a migration a third worker goes on. So the only state here is derived from the request's own
tokens: the scheduler sends a request's TokenHistory (prompt and output tokens so far) once per block table,
with its first chunk that samples (a new request, a preempted one re-admitted, a transferred or migrated
one), and each token sampled afterwards is counted here as it is drawn. A request's state lives as long as
its table at the runner: `ModelInput.finished_request_ids` drops both.
A processor that needs state per request (a grammar matcher, replaying the history) implements the same four
methods; stateless ones inherit the no-ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from llm_engine.batch import TokenHistory
from llm_engine.params import SamplingParams


@dataclass(frozen=True)
class SamplingRows:
    """The rows of one forward's [S, V] logits: which request each is, its parameters, its output count."""

    request_ids: tuple[str, ...]
    params: tuple[SamplingParams, ...]
    output_indices: tuple[int, ...]  # output tokens each request already has


class LogitsProcessor:
    """One step of logits processing. apply() may change `logits` in place (they are the processed copy)."""

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        """The request's tokens so far (its state here starts afresh)."""

    def record(self, rows: SamplingRows, token_ids: torch.Tensor) -> None:
        """The tokens just chosen for `rows` ([S])."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """These requests' tables are gone from the runner: drop their state."""

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        raise NotImplementedError


class LogitBias(LogitsProcessor):
    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        entries = [(row, token, bias) for row, p in enumerate(rows.params) for token, bias in p.logit_bias]
        if not entries:
            return
        row_ids, token_ids, biases = zip(*entries, strict=True)
        index = (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                          accumulate=True)


class MinTokens(LogitsProcessor):
    """EOS and the stop tokens cannot be chosen before min_tokens output tokens."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        pairs = enumerate(zip(rows.params, rows.output_indices, strict=True))
        cells = [(row, token) for row, (p, index) in pairs
                 if index < p.min_tokens for token in (*self.eos_token_ids, *p.stop_token_ids)]
        if cells:
            row_ids, token_ids = zip(*cells, strict=True)
            logits[list(row_ids), list(token_ids)] = float("-inf")


class Penalties(LogitsProcessor):
    """presence, frequency and repetition penalties, as vLLM applies them:
        repetition: a logit of a token seen in the prompt or the output is divided by the penalty when
                    positive, multiplied when negative;
        frequency:  minus penalty × the token's count in the output;  presence: minus penalty if it occurs.
    State: a row of output-token counts [V] and of prompt-token presence [V] per request that uses them, in
    two growing [rows, V] tensors, so a step gathers the batch's rows and applies each penalty at once."""

    def __init__(self, vocab_size: int, device: torch.device, num_rows: int = 8) -> None:
        self.vocab_size = vocab_size
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)  # [R, V]
        self.in_prompt = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)  # [R, V]
        self._rows: dict[str, int] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        if not params.has_penalties:
            return
        row = self._rows.get(request_id)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[request_id] = self._free.pop()
        device = self.counts.device
        self.counts[row].zero_()
        outputs = torch.tensor(history.output_token_ids, dtype=torch.long, device=device)
        self.counts[row].index_add_(0, outputs, torch.ones(len(outputs), dtype=torch.int32, device=device))
        self.in_prompt[row].zero_()
        self.in_prompt[row, list(history.prompt_token_ids)] = True

    def _grow(self) -> None:
        old = len(self.counts)
        self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
        self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
        self._free = list(range(2 * old - 1, old - 1, -1)) + self._free

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free.append(row)

    def _batch_rows(self, rows: SamplingRows) -> tuple[list[int], list[int]]:
        """(logits rows, state rows) of the requests with penalties."""
        pairs = [(i, self._rows[r]) for i, r in enumerate(rows.request_ids) if r in self._rows]
        return [i for i, _ in pairs], [s for _, s in pairs]

    def record(self, rows: SamplingRows, token_ids: torch.Tensor) -> None:
        if not self._rows:
            return
        logit_rows, state_rows = self._batch_rows(rows)
        if state_rows:
            index = (torch.tensor(state_rows, device=self.counts.device), token_ids[logit_rows])
            self.counts.index_put_(index, torch.ones(len(state_rows), dtype=torch.int32,
                                                     device=self.counts.device), accumulate=True)

    def apply(self, logits: torch.Tensor, rows: SamplingRows) -> None:
        if not self._rows:
            return
        logit_rows, state_rows = self._batch_rows(rows)
        if not state_rows:
            return
        device = logits.device
        params = [rows.params[i] for i in logit_rows]
        counts = self.counts[state_rows].to(logits.dtype)  # [P, V]
        in_output = counts > 0
        selected = logits[logit_rows]  # [P, V], a copy
        repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)
        seen = in_output | self.in_prompt[state_rows]
        factor = torch.where(seen, repetition[:, None], 1.0)
        selected = torch.where(selected > 0, selected / factor, selected * factor)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)
        presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)
        selected -= frequency[:, None] * counts + presence[:, None] * in_output
        logits[logit_rows] = selected


class LogitsPipeline:
    """The runner's processors, in order; the one object it calls."""

    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], device: torch.device,
                 extra: Sequence[LogitsProcessor] = ()) -> None:
        # `extra` come last: a grammar's mask decides among what the others left (it only removes tokens).
        self.processors: list[LogitsProcessor] = [LogitBias(), MinTokens(eos_token_ids),
                                                  Penalties(vocab_size, device), *extra]

    def register(self, request_id: str, params: SamplingParams, history: TokenHistory) -> None:
        for processor in self.processors:
            processor.register(request_id, params, history)

    def forget(self, request_ids: Sequence[str]) -> None:
        for processor in self.processors:
            processor.forget(request_ids)

    def record(self, rows: SamplingRows, token_ids: torch.Tensor) -> None:
        for processor in self.processors:
            processor.record(rows, token_ids)

    def apply(self, raw_logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
        """The processed logits ([S, V] float32): `raw_logits` itself when no row asks for processing."""
        if not any(p.processes_logits for p in rows.params):
            return raw_logits
        logits = raw_logits.clone()
        for processor in self.processors:
            processor.apply(logits, rows)
        return logits
