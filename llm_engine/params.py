"""What a request asks of the engine and what it gets back beside its tokens: SamplingParams (validated once,
at construction) and the log-probability records. Torch-free: the stages' messages and the gateway import it;
the sampler that applies these parameters to logits is llm_engine/sampling.py, the logprobs' computation
llm_engine/logprobs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from llm_engine.structured import GrammarSpec

MAX_LOGPROBS = 20  # most likely alternatives per position, as OpenAI's top_logprobs and vLLM's default
# Rows of [rows, vocab] float32 log-softmax held at once for prompt logprobs (llm_engine/logprobs.py; the
# KV sizing reserves room for them: llm_engine/kv_sizing.py).
PROMPT_ROWS_PER_SLICE = 256


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
    # Not a sampling choice but the request's prefix-cache partition (vLLM's cache_salt), carried here because
    # these parameters go with the request everywhere (both stages, every move): its blocks' hash chain starts
    # from the salt, so only requests with the same salt share cached KV (llm_engine/kv_cache_manager.py).
    cache_salt: str | None = None

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
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            problems.append(f"cache_salt must be a non-empty string or None, got {self.cache_salt!r}")
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


# (token id, log-probability) pairs, most likely first.
TopLogprobs = tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens 1..P-1 (token 0 has no context), each given those before it."""

    logprobs: tuple[float, ...]  # [P - 1]
    top: tuple[TopLogprobs, ...]  # [P - 1] the k most likely tokens at each position; () entries when k = 0
    # [P - 1] each prompt token's rank in its position's distribution (1: the most likely), as vLLM reports
    # it beside the logprob; () from a worker that did not compute them.
    ranks: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """One forward's share of a request's prompt logprobs (prefill is chunked)."""

    request_id: str
    first_position: int  # prompt position of the token logprobs[0] scores (>= 1)
    logprobs: tuple[float, ...]
    top: tuple[TopLogprobs, ...]
    ranks: tuple[int, ...] = ()  # each scored token's rank (1: the most likely at its position)
