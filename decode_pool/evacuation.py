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
Runs on the step loop's thread. It decides and detaches; the worker ends what it returns (Evacuated): each
handed-back stream with its last output, each other one as an abort with "migrate".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from decode_pool.choice_groups import ChoiceGroups
from decode_pool.entry import DecodeEntry
from decode_pool.pull_queue import PullQueue
from kv_transfer import KVHandle
from llm_engine.engine import LLMEngine
from worker_runtime.kv_offers import KVOffers


@dataclass
class Evacuated:
    """What the worker ends with finish_reason "migrate"."""

    # (request id, the handle its KV goes with: offered here, or its unused pull's; None: none)
    handed_back: list[tuple[str, KVHandle | None]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # ended as an abort: recomputed where it goes


class Evacuation:
    def __init__(self, engine: LLMEngine, entries: Mapping[str, DecodeEntry], pulls: PullQueue,
                 groups: ChoiceGroups, migration: KVOffers | None) -> None:
        """Args:
        entries: the worker's requests by id (read, never changed here).
        """
        self.engine = engine
        self._entries = entries
        self._pulls = pulls
        self._groups = groups
        self._migration = migration

    def evacuate(self) -> Evacuated:
        """Hand every request here back (1, 2, else aborted with "migrate")."""
        evacuated = Evacuated()
        for request_id in list(self._entries):
            if not (self._hand_back_unpulled(request_id, evacuated)
                    or self._offer_for_migration(request_id, evacuated)):
                evacuated.aborted.append(request_id)
        return evacuated

    def move_out(self, request_ids: list[str]) -> Evacuated:
        """Hand these requests back: a running stream with its KV offered (2), a prompt not started yet as it
        came (the gateway routes it again); any other stays here."""
        evacuated = Evacuated()
        for request_id in request_ids:
            if request_id not in self._entries or self._offer_for_migration(request_id, evacuated):
                continue
            request = self.engine.scheduler.requests.get(request_id)
            if request is not None and not request.num_computed_tokens and not request.num_output_tokens:
                # A prompt not started here: the gateway routes it again.
                evacuated.aborted.append(request_id)
        return evacuated

    def _hand_back_unpulled(self, request_id: str, evacuated: Evacuated) -> bool:
        """1: hand back a request whose pull has not started, with its handle unused. False: its pull has
        started, or it has several choices (which cannot share one handle elsewhere)."""
        if self._groups.is_group(request_id) or not self._pulls.withdraw(request_id):
            return False
        evacuated.handed_back.append((request_id, self._entries[request_id].request.kv_handle))
        return True

    def _offer_for_migration(self, request_id: str, evacuated: Evacuated) -> bool:
        """2: hand a running stream back with its KV offered; False: not possible here."""
        scheduler = self.engine.scheduler
        request = scheduler.requests.get(request_id)
        if (self._migration is None or request is None or not request.num_output_tokens
                or request.num_computed_tokens != request.num_tokens - 1):
            return False  # no sender, not running, or mid-prefill: evacuated without KV
        if scheduler.detach(request_id) is None:
            return False
        handle = self._migration.offer(request_id, request.num_computed_tokens)
        evacuated.handed_back.append((request_id, handle))
        return True
