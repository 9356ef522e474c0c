"""A decode worker handing streams back (finish_reason "migrate") for the gateway to continue on another
worker: every one when the worker changes role or leaves (evacuate()), or chosen ones when the gateway
clears the worker for a long prompt (move_out()). Each goes back the cheapest way it can:
    1. AWAITING_BLOCKS (its pull not started): with its KV handle unused; the next worker pulls that KV
       from where it is (the prefill worker) instead of recomputing it;
    2. RUNNING, with a migration sender: detached with its blocks, its KV offered
       (worker_runtime/kv_offers.py); its last output carries the handle, and the worker holds work until the
       lease ends;
    3. otherwise (pulling, mid-prefill, no sender): evacuate() aborts it with "migrate" and the next
       worker recomputes it; move_out() keeps it here, unless it is a prompt not started yet.
Runs on the step loop's thread, through the worker's own finish and abort.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from decode_pool.choice_groups import ChoiceGroups
from decode_pool.entry import DecodeEntry
from decode_pool.messages import DecodeOutput
from decode_pool.pull_queue import PullQueue
from kv_transfer import KVHandle
from llm_engine.engine import LLMEngine
from llm_engine.finish_reason import FinishReason
from worker_runtime.kv_offers import KVOffers

# (request id, reason, now, last output)
FinishCallback = Callable[[str, FinishReason, float, DecodeOutput], None]
AbortCallback = Callable[[str, FinishReason], None]  # (request id, finish reason)


class Evacuation:
    def __init__(self, engine: LLMEngine, entries: Mapping[str, DecodeEntry], pulls: PullQueue,
                 groups: ChoiceGroups, migration: KVOffers | None, finish: FinishCallback,
                 abort: AbortCallback) -> None:
        """Args:
        entries: the worker's requests by id (read, never changed here).
        finish, abort: the worker's own: end a request with this output, or as an abort does.
        """
        self.engine = engine
        self._entries = entries
        self._pulls = pulls
        self._groups = groups
        self._migration = migration
        self._finish = finish
        self._abort = abort

    def evacuate(self) -> None:
        """Hand every request here back (1, 2, else aborted with "migrate")."""
        for request_id in list(self._entries):
            if not (self._hand_back_unpulled(request_id) or self._offer_for_migration(request_id)):
                self._abort(request_id, FinishReason.MIGRATE)

    def move_out(self, request_ids: list[str]) -> None:
        """Hand these requests back: a running stream with its KV offered (2), a prompt not started yet as it
        came (the gateway routes it again); any other stays here."""
        for request_id in request_ids:
            if request_id not in self._entries or self._offer_for_migration(request_id):
                continue
            request = self.engine.scheduler.requests.get(request_id)
            if request is not None and not request.num_computed_tokens and not request.num_output_tokens:
                # A prompt not started here: the gateway routes it again.
                self._abort(request_id, FinishReason.MIGRATE)

    def _hand_back_unpulled(self, request_id: str) -> bool:
        """1: hand back a request whose pull has not started, with its handle unused. False: its pull has
        started, or it has several choices (which cannot share one handle elsewhere)."""
        if self._groups.is_group(request_id) or not self._pulls.withdraw(request_id):
            return False
        self._hand_back(request_id, self._entries[request_id].request.kv_handle)
        return True

    def _offer_for_migration(self, request_id: str) -> bool:
        """2: hand a running stream back with its KV offered; False: not possible here."""
        scheduler = self.engine.scheduler
        request = scheduler.requests.get(request_id)
        if (self._migration is None or request is None or not request.num_output_tokens
                or request.num_computed_tokens != request.num_tokens - 1):
            return False  # no sender, not running, or mid-prefill: evacuated without KV
        if scheduler.detach(request_id) is None:
            return False
        self._hand_back(request_id, self._migration.offer(request_id, request.num_computed_tokens))
        return True

    def _hand_back(self, request_id: str, handle: KVHandle | None) -> None:
        now = time.time()
        migrate = FinishReason.MIGRATE
        self._finish(request_id, migrate, now,
                     DecodeOutput(request_id, (), (), now, finish_reason=migrate, kv_handle=handle))
