"""The decode worker's requests with several choices (OpenAI's `n`; see llm_engine/choices.py).

Lifecycle of a group on the worker:
    GROUPED (one entry under the request's id, from AWAITING_BLOCKS through TRANSFERRING: the prompt's KV is
      pulled once, into the group's own table)
      → SPLIT when the pull ends: each remaining choice becomes a request of its own (its id, its sampling):
        pull DONE: forked from the pulled blocks (full blocks shared by reference, the partial last block
        copied per choice: LLMEngine.fork_blocks) and RUNNING at once, no recomputation;
        pull FAILED, or no block left for the copies: each choice recomputes prompt + its first token here.
    Before the split, the gateway already addresses each choice by its own id: abort(choice) drops that choice
    from the group (its final output goes at once) and the last one dropped aborts the group; a group that
    ends before its split (abort, evacuation, failure) ends every remaining choice with the same
    finish_reason, without a KV handle (one lease cannot be pulled by n workers: an evacuated choice is
    recomputed where it goes).
Plain bookkeeping: the worker calls in at those points; nothing here touches the engine's KV.
"""

from __future__ import annotations

import dataclasses

from decode_pool.messages import DecodeOutput, DecodeRequest
from llm_engine.choices import FirstToken, choice_request_id
from llm_engine.request import Request


class ChoiceGroups:
    def __init__(self) -> None:
        self._remaining: dict[str, list[FirstToken]] = {}  # group id → its choices not dropped yet
        self._group_of: dict[str, str] = {}  # choice id → its group's id (until the split)

    def add(self, request: DecodeRequest) -> None:
        self._remaining[request.request_id] = list(request.choices)
        for choice_id in request.output_request_ids:
            self._group_of[choice_id] = request.request_id

    def is_group(self, request_id: str) -> bool:
        return request_id in self._remaining

    def group_of(self, choice_id: str) -> str | None:
        """The unsplit group the choice belongs to; None once split (or for any other request)."""
        return self._group_of.get(choice_id)

    def num_choices(self, request_id: str) -> int:
        """Choices the request still stands for (1 for a plain request)."""
        return len(self._remaining.get(request_id, ())) or 1

    def drop(self, choice_id: str) -> bool:
        """Take one choice out of its unsplit group; returns whether the group has none left."""
        group_id = self._group_of.pop(choice_id)
        remaining = self._remaining[group_id]
        remaining[:] = [c for c in remaining if choice_request_id(group_id, c.index) != choice_id]
        return not remaining

    def split(self, group: DecodeRequest, eos_token_ids: frozenset[int]
              ) -> list[tuple[DecodeRequest, Request]]:
        """End the group: each remaining choice as the DecodeRequest it now is on this worker and the engine
        request that continues it (prompt + its first token, nothing computed yet)."""
        parts = []
        for choice in self._forget(group.request_id):
            choice_id = choice_request_id(group.request_id, choice.index)
            sampling = group.sampling.for_choice(choice.index)
            request = DecodeRequest(choice_id, group.prompt_token_ids, sampling, choice.token_id,
                                    choice.logprob, first_top_logprobs=choice.top_logprobs)
            engine_request = Request(
                choice_id, list(group.prompt_token_ids), sampling, eos_token_ids,
                output_token_ids=[choice.token_id],
                output_logprobs=[] if choice.logprob is None else [choice.logprob],
                output_top_logprobs=[choice.top_logprobs] if choice.top_logprobs else [],
            )
            parts.append((request, engine_request))
        return parts

    def fan_out(self, group_id: str, output: DecodeOutput) -> list[DecodeOutput]:
        """A group's final output (it ended before its split), as each remaining choice's."""
        return [dataclasses.replace(output, request_id=choice_request_id(group_id, c.index), kv_handle=None)
                for c in self._forget(group_id)]

    def _forget(self, group_id: str) -> list[FirstToken]:
        remaining = self._remaining.pop(group_id, [])
        for choice in remaining:
            self._group_of.pop(choice_request_id(group_id, choice.index), None)
        return remaining
