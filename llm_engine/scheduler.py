"""Iteration-level scheduler with chunked prefill, prefix sharing and preemption by recomputation.

Queues: WAITING (a deque, arrival order; preempted requests go back to its front)
        → RUNNING (holds blocks; every step each gets its next chunk or its one decode token).
A request whose KV arrived from elsewhere (a transfer) joins RUNNING directly through add_running().
Each step:  schedule() → ModelInput  →  ModelRunner.execute  →  update(ModelInput, ModelOutput).
schedule() serves running requests first, oldest first, within a token budget per forward (so one long prompt
is cut into chunks and cannot hold the others back); while any running request decodes, prompt tokens also fit
a second, smaller budget (prefill_budget_beside_decode, set by a worker that decodes from its measured step
times: stall-free batching, so that a prompt prefilled beside running streams delays each of their steps by a
bounded slice instead of its whole prefill). When blocks run short it preempts the newest running request
(frees its blocks, keeps its tokens, re-queues it). Then it admits waiting requests while budget, sequence
slots and blocks last, keeping `watermark_blocks` free so that admitting a request does not at once preempt
the running ones. Finished requests leave through release(), which frees their blocks (a prefill worker
overrides it: its blocks wait for the transfer). When nothing runs and the waiting requests do not fit,
schedule() remembers that, and until a request comes or goes or blocks are freed it answers an empty batch at
once, without looking for cached prefixes again (a worker polling for transfers would otherwise re-hash the
head prompt every poll); while others run, a waiting request's block hashes are kept on it
(Request.block_hashes), so looking up its cached prefix again costs dict lookups, not hashing.
A suspect (Request.suspect_group: it was in the batch of a step that failed on another worker) computes
with the other suspects of its group only (the gateway names the group: one failed step's batch, halved at
each failure after that), on every other step while others run, so that if it breaks the next forward too,
only its group is to blame and the requests beside it are not failed with it. Once it has sampled a token
in such a forward, its suspicion is lifted: it batches like any other request from then on. Group testing,
not one forward per suspect: after a failed batch of 64 the innocent go on at full speed after one forward,
and a culprit is named in about six failures, not sixty-four.
Each chunk carries only the blocks its request's table gained since its previous chunk (the runner keeps
the tables), and each forward names the requests that left since the last one, so the runner can drop
their tables. Plain Python: no tensors, no model.
"""

from __future__ import annotations

from collections import deque

from llm_engine.batch import ModelInput, ModelOutput, ScheduledChunk, TokenHistory
from llm_engine.kv_cache_manager import KVCacheManager, chain_root, hash_block
from llm_engine.request import Request, RequestStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermark_blocks: int = 0) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Requests ever added: with the pool's count of frees, tells whether anything changed.
        self._num_added = 0
        self._stalled_at: tuple[int, int, int] | None = None  # (added, requests, frees) at an empty batch
        # Blocks of each request's current table already sent to the runner in its chunks.
        self._num_sent_blocks: dict[str, int] = {}
        # Requests with a table at the runner that left (finished, aborted, preempted) since the last forward.
        self._left: list[str] = []
        # Requests whose TokenHistory the runner holds for its current table (sent with a sampling chunk).
        self._history_sent: set[str] = set()
        # Prompt tokens one forward may carry while any running request decodes (None: no limit beyond
        # max_num_batched_tokens).
        self.prefill_budget_beside_decode: int | None = None
        self._num_turns = 0  # steps since a suspect was first seen: suspect groups take every other turn

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._num_added += 1

    def add_running(self, request: Request) -> None:
        """Join a request whose first `num_computed_tokens` tokens already have KV in its blocks."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not self.kv.has(request.request_id):
            raise RuntimeError(f"request {request.request_id!r} holds no blocks")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._num_added += 1

    def release(self, request: Request) -> None:
        """A finished request leaves: its blocks go back to the pool."""
        self.kv.free(request.request_id)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is and free its blocks; returns it, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request_id)
        self._forget(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def detach(self, request_id: str) -> Request | None:
        """Take a RUNNING request out of the schedule but leave its blocks to the caller (who frees them
        with kv.free once done with them: a migrating stream's KV is read by another worker first).
        Returns it, or None if it is not running (waiting requests have no KV worth keeping)."""
        request = self.requests.get(request_id)
        if request is None or request not in self.running:
            return None
        del self.requests[request_id]
        self.running.remove(request)
        self._forget(request_id)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def _forget(self, request_id: str) -> None:
        """The request's current table is gone: the runner may drop its copy (told with the next forward)."""
        self._history_sent.discard(request_id)
        if self._num_sent_blocks.pop(request_id, None) is not None:
            self._left.append(request_id)

    def _prefix_hashes(self, request: Request) -> list[bytes]:
        """Chained hashes of the full blocks of all but the last token, each block hashed once per request."""
        if not self.kv.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            return []  # prompt logprobs need every prompt token computed: no cached prefix
        block_size = self.kv.block_size
        hashes = request.block_hashes
        num_full = (request.num_tokens - 1) // block_size
        if len(hashes) < num_full:
            token_ids = request.all_token_ids
            parent = hashes[-1] if hashes else chain_root(request.sampling.cache_salt)
            for index in range(len(hashes), num_full):
                parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
                hashes.append(parent)
        return hashes[:num_full]

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        completes = start + num_new == request.num_tokens
        table = self.kv.block_table(request.request_id)
        num_sent = self._num_sent_blocks.get(request.request_id, 0)
        self._num_sent_blocks[request.request_id] = len(table)
        history = None
        if completes and request.sampling.needs_history and request.request_id not in self._history_sent:
            self._history_sent.add(request.request_id)
            history = TokenHistory(tuple(request.prompt_token_ids), tuple(request.output_token_ids))
        targets: tuple[int, ...] = ()
        if request.sampling.prompt_logprobs is not None and not request.num_output_tokens:
            targets = tuple(request.prompt_token_ids[start + 1 : start + num_new + 1])
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=request.token_ids_between(start, start + num_new),
            start_position=start,
            new_block_ids=tuple(table[num_sent:]),  # usually () for a decode token: no table copy per step
            num_prior_blocks=num_sent,
            sampling=request.sampling if completes else None,
            output_index=request.num_output_tokens,
            history=history,
            prompt_logprob_targets=targets,
            num_prompt_top_logprobs=request.sampling.prompt_logprobs or 0,
        )

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._forget(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> ModelInput:
        progress = (self._num_added, len(self.requests), self.kv.pool.num_free_calls)
        if not self.running and progress == self._stalled_at:
            return ModelInput(())  # nothing changed since the waiting requests last failed to fit
        batch = self._schedule()
        self._stalled_at = None if batch.chunks else progress
        if batch.chunks and self._left:
            # Only a batch with chunks is run: an empty one would lose the news.
            batch = ModelInput(batch.chunks, tuple(self._left))
            self._left = []
        return batch

    @staticmethod
    def _is_decoding(request: Request) -> bool:
        """Its next chunk is its one newest token (not a prompt's, nor a recomputation after preemption)."""
        return request.num_output_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1

    def _suspect_turn(self) -> str | None:
        """The suspect group that computes apart this step, or None (this step is the others')."""
        groups = list(dict.fromkeys(r.suspect_group for r in (*self.running, *self.waiting) if r.is_suspect))
        if not groups:
            return None
        has_others = any(not r.is_suspect for r in (*self.running, *self.waiting))
        self._num_turns += 1
        if has_others and self._num_turns % 2:
            return None
        return groups[(self._num_turns // 2) % len(groups)]

    def _schedule(self) -> ModelInput:
        # Every forward holds one suspect group only, or no suspect at all ("" is the others' group).
        turn = self._suspect_turn() or ""
        budget = self.max_num_batched_tokens
        prefill_budget = budget
        if self.prefill_budget_beside_decode is not None and any(map(self._is_decoding, self.running)):
            prefill_budget = min(budget, self.prefill_budget_beside_decode)
        chunks: list[ScheduledChunk] = []
        preempted = False
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older request
            if request.suspect_group != turn:
                continue  # not this forward's group: a suspect group on its turn, the others on theirs
            is_decoding = self._is_decoding(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget,
                          budget if is_decoding else prefill_budget)
            if num_new == 0:
                continue  # a prompt chunk, and this forward's prompt budget is spent
            total = request.num_computed_tokens + num_new
            while not self.kv.can_append(request.request_id, total):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            self.kv.append(request.request_id, total)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            if not is_decoding:
                prefill_budget -= num_new
        # Admitting while preempting would thrash: the freed blocks belong to the re-queued requests. In
        # arrival order among this forward's group (a waiting suspect holds back nobody else's admission).
        for request in [r for r in self.waiting if r.suspect_group == turn] if not preempted else ():
            if min(budget, prefill_budget) <= 0 or len(self.running) >= self.max_num_seqs:
                break
            token_ids = request.all_token_ids
            hashes = self._prefix_hashes(request)
            cached = len(self.kv.find_cached_prefix(token_ids, hashes)) * self.kv.block_size
            num_new = min(request.num_tokens - cached, budget, prefill_budget)
            if (turn and chunks and num_new < request.num_tokens - cached
                    and request.num_tokens - cached <= self.max_num_batched_tokens):
                break  # a suspect's recompute is not split where one forward holds it: it computes whole
            # With nothing running the reserve protects nobody: admit rather than wait forever.
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.can_allocate(token_ids, cached + num_new, reserve, hashes):
                break
            self.waiting.remove(request)
            request.num_computed_tokens = self.kv.allocate(request.request_id, token_ids, cached + num_new,
                                                           hashes, chain_root(request.sampling.cache_salt))
            if not request.num_preemptions:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            prefill_budget -= num_new
        return ModelInput(tuple(chunks))

    def update(self, batch: ModelInput, output: ModelOutput) -> list[Request]:
        """Advance computed counts, append sampled tokens, release finished requests.

        Returns:
            The requests that gained a token this step (finished ones included).
        """
        for chunk in batch.chunks:
            request = self.requests.get(chunk.request_id)
            if request is None:
                continue  # aborted while the forward ran
            request.num_computed_tokens += chunk.num_tokens
            # Only when a block has just filled: building the token list every step would be wasted work.
            num_full = request.num_computed_tokens // self.kv.block_size
            if self.kv.enable_prefix_caching and num_full > self.kv.num_cached_blocks(request.request_id):
                self.kv.cache_full_blocks(request.request_id, request.all_token_ids,
                                          request.num_computed_tokens)
        for scored in output.prompt_logprobs:
            request = self.requests.get(scored.request_id)
            if request is not None:
                request.add_prompt_logprobs(scored)
        advanced = []
        for sampled in output.sampled:
            request = self.requests.get(sampled.request_id)
            if request is None:
                continue
            request.append_token(sampled.token_id, sampled.logprob, sampled.top_logprobs)
            request.suspect_group = ""  # it computed a token in its group's own forward: suspicion lifted
            if sampled.other_choices:
                request.other_first_tokens = sampled.other_choices
            advanced.append(request)
            if request.is_finished:
                self.running.remove(request)
                del self.requests[request.request_id]
                self._forget(request.request_id)
                self.release(request)
        return advanced
