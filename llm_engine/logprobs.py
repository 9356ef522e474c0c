"""Log-probabilities the API returns: of each sampled token, of its most likely alternatives, and of the
prompt's tokens (OpenAI's `logprobs`/`top_logprobs`, and `echo` with logprobs for loglikelihood scoring).

All of them are the model's own distribution: a log-softmax of the raw logits, before logit_bias, penalties,
temperature and filtering (as vLLM's default "raw" logprobs), so they equal a plain forward's log-softmax.
"""

from __future__ import annotations

import torch

from llm_engine.params import PROMPT_ROWS_PER_SLICE, PromptLogprobsChunk, SamplingParams, TopLogprobs


def _top(logprobs: torch.Tensor, ks: list[int]) -> list[TopLogprobs]:
    """Each row's ks[row] most likely tokens. logprobs: [R, V]."""
    max_k = max(ks, default=0)
    if max_k == 0:
        return [() for _ in ks]
    values, indices = torch.topk(logprobs, max_k, dim=-1)  # [R, max_k]
    pairs = zip(indices.tolist(), values.tolist(), strict=True)
    return [tuple(zip(i[:k], v[:k], strict=True)) for (i, v), k in zip(pairs, ks, strict=True)]


def sampled_logprobs(raw_logits: torch.Tensor, token_ids: torch.Tensor, params: list[SamplingParams]
                     ) -> tuple[list[float], list[TopLogprobs]] | None:
    """The chosen tokens' log-probabilities and each row's top_logprobs alternatives; None when no row asked.

    Args:
        raw_logits: [B, V] float32, the model's logits before any processing.
        token_ids: [B] the chosen tokens.
    """
    if not any(p.logprobs for p in params):
        return None
    logprobs = torch.log_softmax(raw_logits, dim=-1)  # [B, V]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0].tolist()
    return chosen, _top(logprobs, [p.top_logprobs if p.logprobs else 0 for p in params])


def prompt_logprobs(hidden: torch.Tensor, lm_head: torch.nn.Module, request_id: str, first_position: int,
                    targets: tuple[int, ...], k: int) -> PromptLogprobsChunk:
    """Score `targets` (the prompt tokens that follow each row) in slices, so that a long chunk never holds a
    whole [rows, vocab] float32 matrix.

    Args:
        hidden: [len(targets), hidden] the hidden states of the rows whose next token is targets[i].
    """
    values: list[float] = []
    top: list[TopLogprobs] = []
    ranks: list[int] = []
    target = torch.tensor(targets, device=hidden.device)
    for start in range(0, len(targets), PROMPT_ROWS_PER_SLICE):
        end = min(start + PROMPT_ROWS_PER_SLICE, len(targets))
        logprobs = torch.log_softmax(lm_head(hidden[start:end]).float(), dim=-1)  # [rows, V]
        chosen = logprobs.gather(1, target[start:end, None])  # [rows, 1]
        values.extend(chosen[:, 0].tolist())
        ranks.extend(((logprobs > chosen).sum(dim=-1) + 1).tolist())
        top.extend(_top(logprobs, [k] * (end - start)))
    return PromptLogprobsChunk(request_id, first_position, tuple(values), tuple(top), tuple(ranks))
