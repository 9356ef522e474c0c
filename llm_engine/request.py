"""A request's state inside one worker: its tokens, how many of them have KV, and why it finished.

States: WAITING (queued, or preempted back to the queue) → RUNNING (holds blocks, scheduled each step)
→ FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED. A preempted request keeps its output tokens and
recomputes their KV when it runs again. This object never crosses a process boundary.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llm_engine.batch import SampledToken
from llm_engine.finish_reason import FinishReason
from llm_engine.params import PromptLogprobs, PromptLogprobsChunk, SamplingParams, TopLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = FinishReason.STOP.value
    FINISHED_LENGTH = FinishReason.LENGTH.value
    FINISHED_ABORTED = FinishReason.ABORT.value

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> FinishReason:
        """What a finished request reports (ValueError while it is not finished)."""
        return FinishReason(self.value)


@dataclass(eq=False)  # identity, not field equality: `in`/`remove` on queues must not compare token lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)  # when sampling.top_logprobs > 0
    # Scores of prompt tokens 1..P-1 (sampling.prompt_logprobs), filled chunk by chunk; None until then.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[TopLogprobs] | None = None
    prompt_ranks: list[int] | None = None
    # Tokens (prompt, then output) whose KV is in this request's blocks.
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    arrival_time: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    # Chained hashes of the leading full blocks, filled lazily by the scheduler's prefix-cache lookups: tokens
    # only grow, so a hash stays valid, and a request waiting for blocks is not re-hashed at every step.
    block_hashes: list[bytes] = field(default_factory=list)
    # sampling.n > 1: the first tokens of choices 1..n-1 (output_token_ids[0] is choice 0's), drawn with it.
    other_first_tokens: tuple[SampledToken, ...] = ()
    # It was in the batch of a step that failed on another worker: the failure's group, computed apart from
    # every other request until it has sampled a token here (llm_engine/scheduler.py); "": not a suspect.
    suspect_group: str = ""

    @property
    def is_suspect(self) -> bool:
        return bool(self.suspect_group)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> tuple[int, ...]:
        """Tokens [start, end) of prompt + output, without building the whole list (hot path)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return tuple(self.output_token_ids[start - num_prompt : end - num_prompt])
        if end <= num_prompt:
            return tuple(self.prompt_token_ids[start:end])
        return tuple(self.prompt_token_ids[start:]) + tuple(self.output_token_ids[: end - num_prompt])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def add_prompt_logprobs(self, scored: PromptLogprobsChunk) -> None:
        """Store one chunk's prompt scores (a recomputation after preemption overwrites its own)."""
        if self.prompt_logprobs is None or self.prompt_top_logprobs is None or self.prompt_ranks is None:
            self.prompt_logprobs = [0.0] * (self.num_prompt_tokens - 1)
            self.prompt_top_logprobs = [()] * (self.num_prompt_tokens - 1)
            self.prompt_ranks = [0] * (self.num_prompt_tokens - 1)
        start = scored.first_position - 1
        self.prompt_logprobs[start : start + len(scored.logprobs)] = scored.logprobs
        self.prompt_top_logprobs[start : start + len(scored.top)] = scored.top
        self.prompt_ranks[start : start + len(scored.ranks)] = scored.ranks

    def scored_prompt(self) -> PromptLogprobs | None:
        """The prompt's logprobs, once every prompt token is scored (asked for and computed here)."""
        if self.sampling.prompt_logprobs is None:
            return None
        if self.prompt_logprobs is None or self.prompt_top_logprobs is None:
            return PromptLogprobs((), ()) if self.num_prompt_tokens == 1 else None  # or prefilled elsewhere
        return PromptLogprobs(tuple(self.prompt_logprobs), tuple(self.prompt_top_logprobs),
                              tuple(self.prompt_ranks or ()))

    def is_stop_token(self, token_id: int) -> bool:
        """Whether sampling `token_id` ends the request (EOS unless ignored, or a stop token)."""
        hit_eos = token_id in self.eos_token_ids and not self.sampling.ignore_eos
        return hit_eos or token_id in self.sampling.stop_token_ids

    def append_token(self, token_id: int, logprob: float | None, top_logprobs: TopLogprobs = ()) -> None:
        """Add a sampled token and set FINISHED_* if it ends the request."""
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
            if self.sampling.top_logprobs:
                self.output_top_logprobs.append(top_logprobs)
        if self.is_stop_token(token_id):
            self.status = RequestStatus.FINISHED_STOPPED
        elif self.num_output_tokens >= self.sampling.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
