"""The sampler: SamplingParams (llm_engine/params.py) applied to logits.

Seeded sampling is reproducible per request and independent of batch composition, of preemption and of
which worker samples: the generator for output token i is seeded from (seed, i), so the prefill worker
drawing token 0 and the decode worker drawing the rest give the same stream as one worker would.
The common cases cost a few batched operations whatever the batch size: all-greedy rows are one argmax, and
the random rows without a seed are filtered and drawn together; only seeded rows (each with its own
generator) are sampled one by one.
"""

from __future__ import annotations

import torch

from llm_engine.params import SamplingParams


def _generator(seed: int, output_index: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    # Mix the index into the seed so consecutive tokens get unrelated streams.
    generator.manual_seed((seed * 1_000_003 + output_index) & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    # logits: [V] → the same with excluded tokens at -inf. min_p first, as vLLM orders them.
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the most likely token always stays.
        drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop_sorted[0] = False  # even when top_p underflows to 0 in float32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _filter_rows(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor | None = None) -> torch.Tensor:
    """`_filter_top_k_top_p` for many rows at once, each with its own k, p and min_p.

    Args:
        logits: [R, V]; top_k: [R] (0 keeps all); top_p: [R] (1 keeps all); min_p: [R] (0 keeps all).
    """
    vocab = logits.shape[-1]
    if min_p is not None and bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [R, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    uses_k = (top_k > 0) & (top_k < vocab)
    if bool(uses_k.any()):
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [R, 1]
        logits = logits.masked_fill(uses_k[:, None] & (logits < kth), float("-inf"))
    uses_p = top_p < 1.0
    if bool(uses_p.any()):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
        drop_sorted[:, 0] = False  # even when top_p underflows to 0 in float32
        drop_sorted &= uses_p[:, None]
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def _sample_unseeded(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """One token per row of [R, V] logits, drawn from the global generator; argmax where the filtered
    distribution is not finite (a temperature so small that logits/temperature overflows)."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    top_k = torch.tensor([p.top_k for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(_filter_rows(logits / temperature[:, None], top_k, top_p, min_p), dim=-1)
    is_finite = torch.isfinite(probs).all(dim=-1)  # [R]
    drawn = torch.multinomial(torch.where(is_finite[:, None], probs, 1.0), 1)[:, 0]
    return torch.where(is_finite, drawn, logits.argmax(dim=-1))


def choose_tokens(logits: torch.Tensor, params: list[SamplingParams],
                  output_indices: list[int]) -> torch.Tensor:
    """One token per row of [B, V] float32 logits (already through the logits processors): [B] token ids.

    Args:
        output_indices: for each row, how many output tokens the request already has (seeds the generator).
    """
    token_ids = logits.argmax(dim=-1)  # [B]; greedy rows are done here, random rows overwritten below
    unseeded = [row for row, p in enumerate(params) if not p.is_greedy and p.seed is None]
    if unseeded:
        rows = torch.tensor(unseeded, device=logits.device)
        token_ids[rows] = _sample_unseeded(logits[rows], [params[row] for row in unseeded])
    for row, (p, index) in enumerate(zip(params, output_indices, strict=True)):
        if p.is_greedy or p.seed is None:
            continue
        # Seeded rows stay one by one, exactly as before: a row's token must not depend on its batch.
        row_logits = _filter_top_k_top_p(logits[row] / p.temperature, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(row_logits, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            continue
        token_ids[row] = torch.multinomial(probs, 1, generator=_generator(p.seed, index, logits.device))[0]
    return token_ids


def sample(
    logits: torch.Tensor, params: list[SamplingParams], output_indices: list[int]
) -> tuple[list[int], list[float] | None]:
    """Choose one token per row.

    Args:
        logits: [B, V] next-token logits, one row per request that samples this step.
        params: the B requests' sampling parameters.
        output_indices: for each row, how many output tokens the request already has (seeds the generator).

    Returns:
        The chosen token ids, and their log-probabilities under the model's distribution (before temperature
        and filtering) when any request asked for logprobs, else None.
    """
    logits = logits.float()
    token_ids = choose_tokens(logits, params, output_indices)
    chosen = token_ids.tolist()
    if not any(p.logprobs for p in params):
        return chosen, None
    logprobs = torch.log_softmax(logits, dim=-1).gather(1, token_ids[:, None])[:, 0]
    return chosen, logprobs.tolist()
