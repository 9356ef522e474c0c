"""The peer wiring between workers: which worker may pull KV from which, told to each decode or mixed worker.

A decode or mixed worker pulls KV from every prefill worker, and (where the backend can move KV between
decode workers, so that an evacuated stream's KV is pulled rather than recomputed) from every other decode
or mixed worker. connect() adds the pairs a new or re-roled worker takes part in; unwire() removes a worker
whose endpoint goes away (it leaves, or its role changes to or from prefill). Every add_peer and
remove_peer call carries a number from one counter, so that each worker applies them in order. The counter
starts at the clock (microseconds): a fleet actor restarted over the same workers (gateway/fleet/adoption.py)
numbers its calls above any its predecessor sent.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

from gateway.fleet.workers import Worker, WorkerState
from kv_transfer import BackendName, can_move_kv_between_decode_workers
from worker_runtime.roles import Role


class PeerWiring:
    """Owns the add_peer / remove_peer calls over a deployment's `workers` (the same dict, shared)."""

    def __init__(self, workers: dict[str, Worker], backend: BackendName) -> None:
        self.workers = workers
        self.backend = backend
        self._can_migrate = can_move_kv_between_decode_workers(backend)
        # Orders add_peer against remove_peer on each worker.
        self._order = itertools.count(time.time_ns() // 1000)
        self.on_remove: list[Callable[[str], None]] = []  # called with the id of a worker gone from its role

    async def connect(self, new: list[Worker]) -> None:
        """Tell every decode or mixed worker about every worker it may pull KV from, where either is in
        `new`: every prefill worker, and with a backend that moves KV between decode workers every other
        decode or mixed worker."""
        # A pending worker is not connected now: it connects itself once placed and started (bring-up).
        alive = [w for w in self.workers.values() if w.state not in (WorkerState.FAILED, WorkerState.PENDING)]
        sources = [w for w in alive if w.role is Role.PREFILL or (self._can_migrate and w.role.can_decode)]
        decodes = [w for w in alive if w.role.can_decode]
        pairs = [(d, s) for d in decodes for s in sources if s is not d and (d in new or s in new)]
        needed = {s.worker_id: s for _, s in pairs}
        infos = await asyncio.gather(*(s.client.peer_info() for s in needed.values()))
        peers = dict(zip(needed, infos, strict=True))
        await asyncio.gather(*(d.client.add_peer(peers[s.worker_id], s.client, next(self._order))
                               for d, s in pairs))

    def unwire(self, worker: Worker) -> None:
        """The worker's endpoint goes away: the router (on_remove) and every decode or mixed worker forget
        it."""
        for callback in self.on_remove:
            callback(worker.worker_id)
        for decode in self.workers.values():
            if decode is not worker and decode.role.can_decode and decode.state is not WorkerState.FAILED:
                decode.client.remove_peer(worker.worker_id, next(self._order))
