"""How a decode worker's request joins the engine: RUNNING with its pulled KV (the engine computes from the
last token on), or WAITING to be prefilled here (no handle, a FAILED pull, KV that does not match); a group
of choices (n > 1) splits into one engine request per choice, forked from the pulled blocks where there is
room for the copies. Loop thread only."""

from __future__ import annotations

import dataclasses
import logging
import time

from decode_pool.choice_groups import ChoiceGroups
from decode_pool.entry import DecodeEntry
from llm_engine.engine import LLMEngine
from llm_engine.request import Request

logger = logging.getLogger(__name__)


class EngineAdmission:
    def __init__(self, engine: LLMEngine, entries: dict[str, DecodeEntry], groups: ChoiceGroups) -> None:
        """Args:
        entries: the worker's requests by id; a group's entry is replaced by its choices' on split().
        """
        self.engine = engine
        self._entries = entries
        self._groups = groups
        self._eos = frozenset(engine.spec.eos_token_ids)

    def start_local(self, request_id: str) -> None:
        """Prefill the request here (after the tokens the client already has, if any)."""
        request = self._entries[request_id].request
        self.engine.scheduler.add(Request(request_id, list(request.prompt_token_ids), request.sampling,
                                          self._eos, output_token_ids=list(request.generated_token_ids),
                                          suspect_group=request.suspect_group))

    def start_pulled(self, request_id: str, is_pulled: bool, reason: str = "") -> None:
        """A single request's pull ended: it runs from its KV (`is_pulled`) or is recomputed (why: `reason`),
        continuing after the prefill worker's first token or a moved stream's tokens so far."""
        entry = self._entries[request_id]
        request = entry.request
        assert request.kv_handle is not None
        if request.generated_token_ids:  # a stream moved here from a worker that evacuated it
            output_token_ids, output_logprobs = list(request.generated_token_ids), []
        else:
            assert request.first_token_id is not None
            output_token_ids = [request.first_token_id]
            output_logprobs = [] if request.first_logprob is None else [request.first_logprob]
        engine_request = Request(
            request_id, list(request.prompt_token_ids), request.sampling, self._eos,
            output_token_ids=output_token_ids, output_logprobs=output_logprobs,
            output_top_logprobs=[request.first_top_logprobs] if request.first_top_logprobs else [],
            suspect_group=request.suspect_group,
        )
        if is_pulled:
            engine_request.num_computed_tokens = request.kv_handle.num_tokens
            self.engine.scheduler.add_running(engine_request)
            entry.admitted = time.time()
        else:
            logger.warning("pull for %s failed (%s); recomputing the prompt here", request_id, reason)
            self.engine.kv.free(request_id)
            entry.transfer_bytes = 0
            self.engine.scheduler.add(engine_request)

    def split(self, group_id: str, is_pulled: bool) -> None:
        """A group's pull ended (or it never had one): each remaining choice goes on as a request of its own,
        forked from the pulled blocks when `is_pulled` and there is room for the copies, else recomputed."""
        entry = self._entries.pop(group_id)
        handle = entry.request.kv_handle
        parts = self._groups.split(entry.request, self._eos)
        kv = self.engine.kv
        num_tokens = handle.num_tokens if handle is not None else 0
        is_pulled = is_pulled and self.engine.block_pool.can_allocate(kv.num_fork_blocks(num_tokens,
                                                                                         len(parts)))
        if is_pulled and parts:
            self.engine.fork_blocks(group_id, [request.request_id for request, _ in parts], num_tokens)
        else:
            kv.free(group_id)
        now = time.time()
        for request, engine_request in parts:
            # Each choice reports the group's one pull (the gateway's timings read one choice's).
            self._entries[request.request_id] = dataclasses.replace(
                entry, request=request, admitted=now if is_pulled else None,
                transfer_bytes=entry.transfer_bytes if is_pulled else 0)
            if is_pulled:
                engine_request.num_computed_tokens = num_tokens
                self.engine.scheduler.add_running(engine_request)
            else:
                self.engine.scheduler.add(engine_request)
