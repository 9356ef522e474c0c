"""Sampling parameters (validated once, at construction) and the sampler that applies them to logits.

Seeded sampling is reproducible per request and independent of batch composition, of preemption and of
which worker samples: the generator for output token i is seeded from (seed, i), so the prefill worker
drawing token 0 and the decode worker drawing the rest give the same stream as one worker would.
The common cases cost a few batched operations whatever the batch size: all-greedy rows are one argmax, and
the random rows without a seed are filtered and drawn together; only seeded rows (each with its own
generator) are sampled one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llm_engine.structured import GrammarSpec

MAX_LOGPROBS = 20  # most likely alternatives per position, as OpenAI's top_logprobs and vLLM's default


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when its generation stops."""

    max_tokens: int = 16  # output tokens to generate at most (the first token included)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, in (0, 1]
    top_k: int = 0  # keep only the k most likely tokens; 0 keeps all
    # Drop tokens less likely than min_p × the most likely one's probability (after temperature), in [0, 1].
    min_p: float = 0.0
    seed: int | None = None  # per-request seed for reproducible random sampling
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation (EOS is added by the engine)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks want fixed output lengths)
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each step (0..MAX_LOGPROBS)
    # The log-probability of every prompt token but the first, with its k most likely alternatives (k >= 0);
    # None: none. Computed where the prompt is prefilled; such a prompt does not read the prefix cache.
    prompt_logprobs: int | None = None
    # Penalties over the tokens so far, as vLLM and OpenAI define them (llm_engine/logits_processors.py).
    presence_penalty: float = 0.0  # subtracted once from every token already generated, in [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens, in [-2, 2]
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or the output (CTRL's), in (0, 2]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit in [-100, 100]) pairs
    min_tokens: int = 0  # EOS and stop_token_ids cannot end generation before this many output tokens
    # Token sequences the output never contains (vLLM's bad_words, tokenized by the gateway): the last token
    # of each is forbidden wherever the output so far ends with the ones before it.
    bad_words: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: any)
    # Choices drawn from the prompt's last logits (the first token only, each with its own seed: see
    # llm_engine/choices.py); each choice then decodes as a request of its own with n = 1 (for_choice).
    n: int = 1
    # The output must be this grammar's text (structured outputs, forced tool calls): grammar_mask.py.
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        problems = self._sampling_problems() + self._processing_problems()
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    def _sampling_problems(self) -> list[str]:
        problems = []
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            problems.append(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.min_p, int | float) or not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            problems.append(f"seed must be an integer or None, got {self.seed!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            problems.append(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        return problems

    def _processing_problems(self) -> list[str]:
        problems = []
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            problems.append(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], "
                            f"got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            problems.append(f"prompt_logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                            f"got {self.prompt_logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                problems.append(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.repetition_penalty, int | float) or not 0.0 < self.repetition_penalty <= 2.0:
            problems.append(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty!r}")
        if any(not _is_int(t) or t < 0 or not isinstance(b, int | float) or not -100.0 <= b <= 100.0
               for t, b in self.logit_bias):
            problems.append("logit_bias must map non-negative token ids to biases in [-100, 100]")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            problems.append(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if any(not word or any(not _is_int(t) or t < 0 for t in word) for word in self.bad_words):
            problems.append("bad_words must be non-empty sequences of non-negative token ids")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)):
            problems.append("allowed_token_ids must be None or a non-empty sequence of non-negative "
                            "token ids")
        if not _is_int(self.n) or self.n < 1:
            problems.append(f"n must be an integer >= 1, got {self.n!r}")
        return problems

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters choice `index` decodes with: one choice, its own seed (llm_engine/choices.py)."""
        seed = None if self.seed is None else choice_seed(self.seed, index)
        return replace(self, n=1, seed=seed)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether the next token depends on the tokens so far (the sampler must be told them): penalties
        count them, a grammar's matcher replays them."""
        return self.has_penalties or self.grammar is not None or any(len(w) > 1 for w in self.bad_words)

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes the model's logits before temperature and filtering."""
        return (self.needs_history or bool(self.logit_bias) or self.min_tokens > 0 or bool(self.bad_words)
                or self.allowed_token_ids is not None)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request seeded with `seed` (OpenAI's `n`): choice 0 keeps it, so that
    n = 1 equals choice 0 of n > 1; the others get seeds unrelated to it and to each other (the per-token
    generator mixes the output index in after this)."""
    if index == 0:
        return seed
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


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
