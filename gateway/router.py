"""Picks the workers for a request: decode first (it must have room), then prefill.

Decode: the worker with the fewest tokens reserved for requests running there (its KV use to come).
Prefill: the fewest prompt tokens queued, minus the prompt tokens it probably holds in its prefix cache.
The router counts what it has sent and not yet seen finish, per worker, so a burst of arrivals spreads out
at once instead of piling onto whichever worker looked idle in the last load report; and it remembers the
block hashes of the prompts it sent to each prefill worker (the same stable hashes the workers use), in a
bounded LRU per worker, as its belief of what each prefix cache holds.
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict

from gateway.pools import PDDeployment
from gateway.workers import Worker
from llm_engine.kv_cache_manager import prefix_hashes

# Block hashes remembered per prefill worker; beyond this the oldest are forgotten (as the worker evicts).
MAX_REMEMBERED_BLOCKS = 65536


class Router:
    def __init__(self, deployment: PDDeployment) -> None:
        self.deployment = deployment
        self.block_size = deployment.config.engine.block_size
        deployment.on_remove.append(self.forget)
        self.prefill_tokens: defaultdict[str, int] = defaultdict(int)  # prompt tokens sent, not yet prefilled
        self.decode_tokens: defaultdict[str, int] = defaultdict(int)  # tokens of requests decoding there
        self._cached: defaultdict[str, OrderedDict[bytes, None]] = defaultdict(OrderedDict)

    def forget(self, worker_id: str) -> None:
        """A worker left the deployment: drop what the router remembers of it."""
        self._cached.pop(worker_id, None)
        if not self.prefill_tokens.get(worker_id):
            self.prefill_tokens.pop(worker_id, None)
        if not self.decode_tokens.get(worker_id):
            self.decode_tokens.pop(worker_id, None)

    def in_flight(self, worker_id: str) -> int:
        """Tokens of requests sent to the worker and not yet back (0: nothing on its way there)."""
        return self.prefill_tokens.get(worker_id, 0) + self.decode_tokens.get(worker_id, 0)

    def pick_decode(self, workers: list[Worker] | None = None) -> Worker:
        """The least loaded of `workers` (default: every active decode worker)."""
        workers = self.deployment.active("decode") if workers is None else workers
        if not workers:
            raise RuntimeError("no active decode worker")
        return min(workers, key=lambda w: self.decode_tokens[w.worker_id])

    def pick_prefill(self, prompt_token_ids: tuple[int, ...], workers: list[Worker] | None = None) -> Worker:
        """The best of `workers` (default: every active prefill worker) for this prompt."""
        workers = self.deployment.active("prefill") if workers is None else workers
        if not workers:
            raise RuntimeError("no active prefill worker")
        hashes = prefix_hashes(prompt_token_ids, self.block_size)
        chosen = min(workers, key=lambda w: self.prefill_tokens[w.worker_id] - self.cached_tokens(w, hashes))
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
