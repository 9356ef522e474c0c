"""The messages between a scheduler and the model runner: what one forward computes, and what it sampled.

One forward carries any mix of prefill chunks and decode tokens (iteration-level batching); each entry
says which new tokens a request computes, at which position they start, and which KV blocks its table
gained since its previous chunk. The model runner keeps every scheduled request's block table itself
(persistent rows, see block_tables.py), so a step sends only the blocks that are new, not whole tables;
`finished_request_ids` tells it which tables to forget.
"""

from __future__ import annotations

from dataclasses import dataclass

from llm_engine.params import PromptLogprobsChunk, SamplingParams, TopLogprobs


@dataclass(frozen=True)
class TokenHistory:
    """A request's tokens so far, for the logits processors that depend on them (penalties)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of one forward."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens this forward computes (a prompt chunk, or the one latest token)
    start_position: int  # position of token_ids[0]: tokens before it already have KV in the blocks
    # Blocks appended to the request's table since its previous chunk; together with the earlier chunks'
    # they cover start_position + len(token_ids). num_prior_blocks == 0 starts a new table (first chunk,
    # or the first after a preemption: the old table was freed).
    new_block_ids: tuple[int, ...]
    num_prior_blocks: int  # length of the table before new_block_ids (the runner already holds those)
    sampling: SamplingParams | None  # None: no token is sampled (a prompt chunk that is not the last)
    output_index: int = 0  # output tokens the request already has (seeds the per-token generator)
    # Sent once per table, with the first chunk that samples, to requests whose sampling depends on the tokens
    # so far (the runner counts the tokens it samples after that); None otherwise.
    history: TokenHistory | None = None
    # The prompt tokens that follow each of token_ids (at most len(token_ids)), when the request asked for
    # prompt logprobs and has no output yet: the runner scores them. () otherwise.
    prompt_logprob_targets: tuple[int, ...] = ()
    num_prompt_top_logprobs: int = 0  # alternatives to score at each of those positions

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens the attention of this chunk's last token sees, itself included."""
        return self.start_position + len(self.token_ids)


@dataclass(frozen=True)
class ModelInput:
    """A whole forward: the scheduler's output, the model runner's input."""

    chunks: tuple[ScheduledChunk, ...]
    # Requests whose block tables the runner may drop (finished, aborted or preempted since the last
    # forward); dropped before this forward's chunks are read, so a re-admitted request starts afresh.
    finished_request_ids: tuple[str, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SampledToken:
    """The token one request gained from a forward."""

    request_id: str
    token_id: int
    logprob: float | None  # log-probability of token_id when the request asked for logprobs
    top_logprobs: TopLogprobs = ()  # the request's top_logprobs most likely tokens, when it asked
    # The first tokens of choices 1..n-1, drawn from the same logits (sampling.n > 1, first token only);
    # this token is choice 0's.
    other_choices: tuple[SampledToken, ...] = ()


@dataclass(frozen=True)
class ModelOutput:
    """What a forward produced: one SampledToken per chunk that asked for sampling, in chunk order."""

    sampled: tuple[SampledToken, ...]
    prompt_logprobs: tuple[PromptLogprobsChunk, ...] = ()  # for the chunks with prompt_logprob_targets
