"""One request's state on its way through both stages, in one place: what it asks for, what the client has
been sent, its counters and deadlines, and the ids of its attempts on workers. The orchestrator and the
stages (prefill_stage.py, decode_stage.py, choices.py) read and write it; it imports none of them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.requests.deadlines import RequestDeadlines
from llm_engine.params import SamplingParams


@dataclass
class RequestState:
    request_id: str  # the client's: its events carry it
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    deadlines: RequestDeadlines
    block_hashes: list[bytes] | None = None  # the prompt's prefix hashes, when the gateway computed them
    generated: list[int] = field(default_factory=list)  # every token the client has been sent
    num_migrations: int = 0  # moves forced by failed decode workers
    num_moves: int = 0  # moves because a decode worker changed role or left (not failures)
    num_failed_steps: int = 0  # decode workers whose failing step had this request in its batch
    suspect_group: str = ""  # since such a step: its group of suspects, until a worker lifts it
    local_prefill_reason: str = ""  # why the decode worker prefilled the prompt; empty: the prefill pool
    # Handed back before its first token (its decode worker left): the orchestrator routes it again from the
    # start, so that a long prompt goes to the prefill pool rather than to whichever worker takes the stream.
    is_requeued: bool = False
    num_attempts: int = 0  # submissions to workers so far (new_attempt_id())

    def new_attempt_id(self) -> str:
        """The id the request's next submission to a worker goes under: the request's own the first time,
        then `<request id>~<n>`. A worker remembers the ids it aborted (and refuses them) and holds blocks
        under live ones: a new attempt (after a closed stream, a lost, refusing or misrouted worker, a move)
        is never taken for the one before it."""
        self.num_attempts += 1
        return self.request_id if self.num_attempts == 1 else f"{self.request_id}~{self.num_attempts - 1}"

    @property
    def stage_deadline(self) -> tuple[str, float]:
        """The stage the request is in and its deadline: prefill_by until the first token (a worker that
        prefills the prompt itself keeps the TTFT bound), then finish_by."""
        deadlines = self.deadlines
        return ("decode", deadlines.finish_by) if self.generated else ("prefill", deadlines.prefill_by)

    @staticmethod
    def time_left(deadline: float) -> float:
        return max(0.0, deadline - time.time())

    def late(self, stage: str, deadline: float) -> str:
        budget = deadline - self.deadlines.arrival
        return f"the request passed its deadline in the {stage} stage ({budget:.1f} s after arrival)"
