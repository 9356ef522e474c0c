"""Picks the workers for a request: decode first (it must have room), then prefill.

Decode: the worker with the fewest tokens reserved for requests bound for it or running there (its KV use
to come). A request's reservation is booked the moment it picks its decode worker, before its prefill, and
moves with it if it moves: a burst of arrivals spreads across decode workers, and a drain or role change
of that worker waits for it (in_flight). A long prompt that the picked worker will prefill itself (a mixed
worker) goes instead to the worker with the fewest requests booked (then the fewest tokens): the one with
the least to protect, since its chunks stall every stream decoding beside them; a worker busy with one long
prompt is a better host for the next than one decoding three short streams. And the streams already decoding
on that host are moved off it first (streams_to_clear: live KV migration to the other decode or mixed
workers), so that the prompt's chunks stall nobody: the worker's role is a default, not a wall.
Prefill: the fewest prompt tokens queued, minus the prompt tokens it probably holds in its prefix cache
(least loaded alone with --prefill-routing load); or none, when the LocalPrefillPolicy says the decode
worker should prefill the prompt itself.
The router counts what it has sent and not yet seen finish, per worker, so a burst of arrivals spreads out
at once instead of piling onto whichever worker looked idle in the last load report; and it remembers the
block hashes of the prompts it sent to each prefill worker (the same stable hashes the workers use), in a
bounded LRU per worker, as its belief of what each prefix cache holds.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.fleet.workers import Worker
from gateway.requests.fleet_view import FleetView
from llm_engine.kv_cache_manager import prefix_hashes
from worker_runtime.roles import Role

# Block hashes remembered per prefill worker; beyond this the oldest are forgotten (as the worker evicts).
MAX_REMEMBERED_BLOCKS = 65536
# A long prompt: prefilled beside decoding streams it stalls them (the router isolates it or moves the streams
# first; the ratio controller's ladder splits a prefill pool off for such prompts). The one home of the bound:
# LocalPrefillPolicy and ControllerPolicy default from it, the tuner's planner is handed it.
LONG_PROMPT_TOKENS = 1024


@dataclass(frozen=True)
class LocalPrefillPolicy:
    """When a decode worker prefills a request itself instead of the prefill pool (conditional
    disaggregation): the handoff costs a prefill round trip and a KV transfer, which a short prompt does not
    repay, and a long prefill queue makes a decode worker's spare step budget the faster path.
    0 turns a rule off (both are off by default: always disaggregate)."""

    max_uncached_tokens: int = 0  # prompts with at most this many tokens not in any prefill cache
    min_prefill_queue_tokens: int = 0  # ... or any size, while every prefill worker has this many queued
    # The queue rule only for prompts with fewer uncached tokens than this (0: any size). The ratio
    # controller sets it to its long-prompt size: long prompts still go to the prefill pool, while a short
    # one is not left waiting behind them.
    queue_rule_below_tokens: int = 0
    # A prompt this long, prefilled by the mixed worker that decodes it, goes to the mixed worker with the
    # fewest requests (the least to protect), not the fewest tokens (0: off).
    isolate_prompts_from_tokens: int = LONG_PROMPT_TOKENS
    # A prompt this long, prefilled by a worker that is decoding streams, has those streams moved to other
    # decode or mixed workers first (with their KV, where the backend can move it; 0: off). A move costs a
    # stream about two of its new worker's steps; a LONG_PROMPT_TOKENS prefill beside it costs it more.
    move_streams_from_tokens: int = LONG_PROMPT_TOKENS
    # The prefill pick: the fewest prompt tokens queued less those the worker's prefix cache probably holds
    # (prefix-aware); False: the fewest queued (least loaded), which `--prefill-routing load` chooses to
    # measure what the prefix costs or saves.
    prefix_aware: bool = True

    def __post_init__(self) -> None:
        if min(self.max_uncached_tokens, self.min_prefill_queue_tokens, self.queue_rule_below_tokens,
               self.isolate_prompts_from_tokens, self.move_streams_from_tokens) < 0:
            raise ValueError(f"local prefill thresholds must be >= 0, got {self}")


@dataclass(frozen=True)
class DecoderShape:
    """What the router knows of one decode or mixed worker when it places a prompt there."""

    worker_id: str
    num_requests: int  # booked there (bound for it or decoding)
    # Requests there that a long prompt's chunks would stall: streams decoding, and prompts waiting to be
    # prefilled (the worker moves a stream with its KV, hands back a prompt not started, keeps the rest).
    streams: tuple[str, ...] = ()


def streams_to_clear(host: DecoderShape, others: list[DecoderShape], num_prompt_tokens: int,
                     policy: LocalPrefillPolicy) -> tuple[str, ...]:
    """The streams to move off `host` before it prefills a prompt of `num_prompt_tokens` itself: all of
    them, for a long prompt, when another worker can take them; none otherwise (a short prompt's step beside
    them costs less than a move)."""
    threshold = policy.move_streams_from_tokens
    if not threshold or num_prompt_tokens < threshold or not others:
        return ()
    return host.streams


class Router:
    def __init__(self, fleet: FleetView, local_prefill: LocalPrefillPolicy | None = None) -> None:
        self.fleet = fleet
        self.local_prefill = local_prefill or LocalPrefillPolicy()
        self.block_size = fleet.block_size
        fleet.on_remove.append(self.forget)
        self.prefill_tokens: defaultdict[str, int] = defaultdict(int)  # prompt tokens sent, not yet prefilled
        # Tokens (prompt + max_tokens) of requests bound for the worker (picked, maybe still prefilling) or
        # decoding there.
        self.decode_tokens: defaultdict[str, int] = defaultdict(int)
        self.decode_requests: defaultdict[str, int] = defaultdict(int)  # ... and how many requests
        # Prompts a decode or mixed worker was sent to prefill itself, not yet prefilled: tokens per worker,
        # and each prompt's length (the ratio controller looks for long ones).
        self.local_prefill_tokens: defaultdict[str, int] = defaultdict(int)
        self.local_prefill_prompts: dict[str, tuple[str, int]] = {}  # request id → (worker id, prompt tokens)
        self.on_local_prefill: list[Callable[[int], None]] = []  # called with its tokens as one starts
        # Streams asked to move off their worker for a long prompt (streams_to_clear), until they have left:
        # no longer beside that prompt, though still subscribed there for the moment.
        self._moving_off: dict[str, str] = {}  # request id → the worker it is leaving
        self._cached: defaultdict[str, OrderedDict[bytes, None]] = defaultdict(OrderedDict)
        # What the counts above hold, by request (worker id → request id → tokens), and where each request is
        # now (RequestRun.at): a drain that waits for them names them.
        self._booked: defaultdict[str, dict[str, int]] = defaultdict(dict)
        self.stages: dict[str, str] = {}

    def forget(self, worker_id: str) -> None:
        """A worker left the deployment or its role: drop what the router remembers of it."""
        self._cached.pop(worker_id, None)
        if not self.prefill_tokens.get(worker_id):
            self.prefill_tokens.pop(worker_id, None)
        if not self.decode_tokens.get(worker_id):
            self.decode_tokens.pop(worker_id, None)
        if not self.decode_requests.get(worker_id):
            self.decode_requests.pop(worker_id, None)
        if not self.local_prefill_tokens.get(worker_id):
            self.local_prefill_tokens.pop(worker_id, None)

    def start_local_prefill(self, worker_id: str, request_id: str, num_tokens: int) -> None:
        self.local_prefill_tokens[worker_id] += num_tokens
        self.local_prefill_prompts[request_id] = (worker_id, num_tokens)
        for listener in self.on_local_prefill:
            listener(num_tokens)

    def end_local_prefill(self, worker_id: str, request_id: str) -> None:
        """The prompt was prefilled (or the request left); idempotent."""
        _, num_tokens = self.local_prefill_prompts.pop(request_id, (worker_id, 0))
        self.local_prefill_tokens[worker_id] -= num_tokens

    def longest_local_prefill(self) -> int:
        """The longest prompt a decode or mixed worker is prefilling for itself now (0: none)."""
        return max((num_tokens for _, num_tokens in self.local_prefill_prompts.values()), default=0)

    def longest_prefill_beside_streams(self) -> int:
        """The longest prompt a decode or mixed worker is prefilling for itself while it decodes other
        requests (0: none): the prompt's chunks stall those streams. A long prompt on a worker with nothing
        else to decode stalls no one."""
        self._forget_moved()
        on_workers = {worker_id: self._request_ids(worker_id)
                      for worker_id, _ in self.local_prefill_prompts.values()}
        is_decoding = {worker_id: any(self._is_stream_on(r, worker_id) for r in ids)
                       for worker_id, ids in on_workers.items()}
        return max((num_tokens for worker_id, num_tokens in self.local_prefill_prompts.values()
                    if is_decoding[worker_id]), default=0)

    def _is_stream_on(self, request_id: str, worker_id: str) -> bool:
        """Whether a request subscribed on the worker decodes there: past its prompt, and not moving off."""
        return request_id not in self.local_prefill_prompts and self._moving_off.get(request_id) != worker_id

    def _forget_moved(self) -> None:
        """Streams that have left the worker they were moving off are ordinary streams again."""
        on = {worker_id: set(self._request_ids(worker_id)) for worker_id in set(self._moving_off.values())}
        for request_id, worker_id in list(self._moving_off.items()):
            if request_id not in on[worker_id]:
                del self._moving_off[request_id]

    def _request_ids(self, worker_id: str) -> list[str]:
        worker = self.fleet.workers.get(worker_id)
        return worker.client.request_ids() if worker is not None else []

    def book_decode(self, worker_id: str, num_tokens: int, request_id: str = "") -> None:
        """A request picked this decode worker: its tokens count there from now until unbook_decode."""
        self.decode_tokens[worker_id] += num_tokens
        self.decode_requests[worker_id] += 1
        self._note(worker_id, request_id, num_tokens)

    def unbook_decode(self, worker_id: str, num_tokens: int, request_id: str = "") -> None:
        self.decode_tokens[worker_id] -= num_tokens
        self.decode_requests[worker_id] -= 1
        self._note(worker_id, request_id, -num_tokens)

    def book_prefill(self, worker_id: str, num_tokens: int, request_id: str = "") -> None:
        """A prompt was sent to this prefill worker: its tokens count there until unbook_prefill."""
        self.prefill_tokens[worker_id] += num_tokens
        self._note(worker_id, request_id, num_tokens)

    def unbook_prefill(self, worker_id: str, num_tokens: int, request_id: str = "") -> None:
        self.prefill_tokens[worker_id] -= num_tokens
        self._note(worker_id, request_id, -num_tokens)

    def _note(self, worker_id: str, request_id: str, num_tokens: int) -> None:
        if not request_id:
            return
        booked = self._booked[worker_id]
        left = booked.get(request_id, 0) + num_tokens
        if left:
            booked[request_id] = left
        else:
            booked.pop(request_id, None)
        if not booked:
            del self._booked[worker_id]

    def in_flight(self, worker_id: str) -> int:
        """Tokens of requests sent to the worker and not yet back (0: nothing on its way there)."""
        return self.prefill_tokens.get(worker_id, 0) + self.decode_tokens.get(worker_id, 0)

    def on_the_way(self, worker_id: str, limit: int = 3) -> str:
        """The requests in_flight counts, each with where it is now (the first `limit`)."""
        booked = list(self._booked.get(worker_id, {}).items())
        named = [f"{request_id} ({num_tokens} tokens): {self.stages.get(request_id, 'between stages')}"
                 for request_id, num_tokens in booked[:limit]]
        return "; ".join(named + ([f"{len(booked) - limit} more"] if len(booked) > limit else []))

    def local_prefill_reason(self, prompt_token_ids: tuple[int, ...], hashes: list[bytes] | None = None
                             ) -> str:
        """Why the decode worker should prefill this prompt itself; empty: send it to the prefill pool.
        Only prompt tokens that no prefill worker is believed to hold count as prompt work. `hashes`: the
        prompt's prefix_hashes, if the caller has them already."""
        policy = self.local_prefill
        prefills = self.fleet.active(Role.PREFILL)
        if not prefills or not (policy.max_uncached_tokens or policy.min_prefill_queue_tokens):
            return ""
        hashes = prefix_hashes(prompt_token_ids, self.block_size) if hashes is None else hashes
        uncached = len(prompt_token_ids) - max(self.cached_tokens(w, hashes) for w in prefills)
        if policy.max_uncached_tokens and uncached <= policy.max_uncached_tokens:
            return f"short prompt: {uncached} uncached tokens <= {policy.max_uncached_tokens}"
        queued = min(self.prefill_tokens[w.worker_id] for w in prefills)
        is_small_enough = not policy.queue_rule_below_tokens or uncached < policy.queue_rule_below_tokens
        if policy.min_prefill_queue_tokens and queued >= policy.min_prefill_queue_tokens and is_small_enough:
            return f"prefill queue: {queued} tokens >= {policy.min_prefill_queue_tokens} on every worker"
        return ""

    def pick_decode(self, workers: list[Worker] | None = None, num_prompt_tokens: int = 0) -> Worker:
        """The least loaded of `workers` (default: every active decode or mixed worker). For a new request's
        long prompt (`num_prompt_tokens`), a mixed worker with the least to protect (see the docstring)."""
        workers = self.fleet.active(Role.DECODE, Role.MIXED) if workers is None else workers
        if not workers:
            raise RuntimeError("no active decode worker")
        threshold = self.local_prefill.isolate_prompts_from_tokens
        mixed = [w for w in workers if w.role is Role.MIXED]
        if threshold and num_prompt_tokens >= threshold and mixed:
            return min(mixed, key=lambda w: (self.decode_requests[w.worker_id],
                                             self.decode_tokens[w.worker_id]))
        return min(workers, key=lambda w: self.decode_tokens[w.worker_id])

    def streams_to_clear(self, host: Worker, num_prompt_tokens: int) -> tuple[str, ...]:
        """The streams to move off `host` before it prefills this prompt itself (see streams_to_clear());
        they count as moving off (not beside the prompt) from now until they have left."""
        if num_prompt_tokens < self.local_prefill.move_streams_from_tokens:
            return ()  # the common case: no look at the workers' requests
        self._forget_moved()
        others = [self._shape(w) for w in self.fleet.active(Role.DECODE, Role.MIXED) if w is not host]
        streams = streams_to_clear(self._shape(host), others, num_prompt_tokens, self.local_prefill)
        self._moving_off.update(dict.fromkeys(streams, host.worker_id))
        return streams

    def _shape(self, worker: Worker) -> DecoderShape:
        # Not another long prompt waiting there: moving it would only take its turn elsewhere (and bounce).
        long = self.local_prefill.move_streams_from_tokens
        streams = tuple(r for r in worker.client.request_ids() if self._moving_off.get(r) != worker.worker_id
                        and self.local_prefill_prompts.get(r, ("", 0))[1] < long)
        return DecoderShape(worker.worker_id, self.decode_requests[worker.worker_id], streams)

    def pick_prefill(self, prompt_token_ids: tuple[int, ...], workers: list[Worker] | None = None,
                     hashes: list[bytes] | None = None) -> Worker:
        """The best of `workers` (default: every active prefill worker) for this prompt (whose
        prefix_hashes are `hashes`, if the caller has them already)."""
        workers = self.fleet.active(Role.PREFILL) if workers is None else workers
        if not workers:
            raise RuntimeError("no active prefill worker")
        hashes = prefix_hashes(prompt_token_ids, self.block_size) if hashes is None else hashes
        if self.local_prefill.prefix_aware:
            chosen = min(workers, key=lambda w: self.prefill_tokens[w.worker_id]
                         - self.cached_tokens(w, hashes))
        else:
            chosen = min(workers, key=lambda w: self.prefill_tokens[w.worker_id])
        remembered = self._cached[chosen.worker_id]
        for block_hash in hashes:
            remembered[block_hash] = None
            remembered.move_to_end(block_hash)
        while len(remembered) > MAX_REMEMBERED_BLOCKS:
            remembered.popitem(last=False)
        return chosen

    def cached_tokens(self, worker: Worker, hashes: list[bytes]) -> int:
        """Prompt tokens the worker probably holds: the longest run of leading blocks sent there before."""
        remembered = self._cached[worker.worker_id]
        num_blocks = 0
        for block_hash in hashes:
            if block_hash not in remembered:
                break
            num_blocks += 1
        return num_blocks * self.block_size
