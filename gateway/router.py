"""Picks the workers for a request: decode first (it must have room), then prefill.

The router counts what it has sent and not yet seen finish, per worker, so a burst of arrivals spreads
out at once instead of piling onto whichever worker looked idle in the last load report.
"""

from __future__ import annotations

from collections import defaultdict

from gateway.pools import PDDeployment, Worker


class Router:
    def __init__(self, deployment: PDDeployment) -> None:
        self.deployment = deployment
        self.prefill_tokens: defaultdict[str, int] = defaultdict(int)  # prompt tokens sent, not yet prefilled
        self.decode_tokens: defaultdict[str, int] = defaultdict(int)  # tokens of requests decoding there

    def pick_decode(self) -> Worker:
        workers = self.deployment.active("decode")
        if not workers:
            raise RuntimeError("no active decode worker")
        return min(workers, key=lambda w: self.decode_tokens[w.worker_id])

    def pick_prefill(self) -> Worker:
        workers = self.deployment.active("prefill")
        if not workers:
            raise RuntimeError("no active prefill worker")
        return min(workers, key=lambda w: self.prefill_tokens[w.worker_id])
