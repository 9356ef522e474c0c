"""Faults the chaos run plants inside real worker actors through Ray's `__ray_call__` (a function run on the
actor instance), beside tests/helpers/actor_faults.py's (slow, raising and held steps; lost releases).
Pickled by value: the workers do not import the benchmarks.

Each injector acts on the worker's step thread where it touches the transfer library (posted to the worker's
inbox).
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from typing import Any

import ray


def _on_step_thread(actor: Any, command: Any) -> None:
    actor.worker._inbox.post(command)
    actor.worker.wake()


def stall_new_pulls(actor: Any, seconds: float) -> int:
    """Pulls the decode worker starts in the next `seconds` send no claim and are never heard of again (a
    lost claim, or a READ that hangs): only each pull's deadline ends it, then the request is recomputed.
    Pulls started before or after the window run as usual. Returns how many wrappers are installed (1)."""
    receiver = actor.worker.receiver
    until = time.monotonic() + seconds
    stalled: set[Any] = actor.__dict__.setdefault("chaos_stalled", set())
    start, advance, abort = (type(receiver)._start, type(receiver)._advance, type(receiver)._abort)

    def started(pull: Any, peer: Any) -> None:
        if time.monotonic() < until:
            from kv_transfer import TransferState

            stalled.add(pull.key)
            pull.state = TransferState.TRANSFERRING  # posted, and never heard of again
            return
        start(receiver, pull, peer)

    def advanced(pull: Any) -> None:
        if pull.key not in stalled:
            advance(receiver, pull)

    def aborted(pull: Any) -> bool:
        if pull.key not in stalled:
            return bool(abort(receiver, pull))
        if time.monotonic() > pull.deadline:  # nothing was posted: done once its deadline has passed
            stalled.discard(pull.key)
            return True
        return False

    def install() -> None:
        receiver._start, receiver._advance, receiver._abort = started, advanced, aborted

    _on_step_thread(actor, install)
    return 1


def add_mismatched_peer(actor: Any) -> str:
    """Offer the decode worker a sender whose KV blocks mean other bytes (twice the KV heads): it must refuse
    it in the caller and serve on. Returns the refusal, or "accepted" (the fault's failure)."""
    known = list(actor.worker.receiver.peers.values())
    if not known:
        return "skipped (no peer)"
    peer = known[0]
    layout = dataclasses.replace(peer.layout, num_kv_heads=peer.layout.num_kv_heads * 2,
                                 block_bytes=peer.layout.block_bytes * 2)
    bad = dataclasses.replace(peer, worker_id=f"chaos-mismatched-{random.randrange(1 << 30)}", layout=layout)
    try:
        actor.worker.add_peer(bad)
    except Exception as refusal:  # IncompatibleLayoutError, as the fleet's wiring would see it
        return f"refused: {type(refusal).__name__}: {refusal}"[:300]
    return "accepted"


def forge_claims(actor: Any, num_claims: int) -> int:
    """From the decode worker's NIXL agent, claim transfer ids its peers never issued (forged handles) and
    ids just below their recent ones (handles long released or expired): each sender must refuse them and
    serve on, and the receiver must ignore answers for pulls it does not hold. Returns the claims sent."""
    receiver = actor.worker.receiver
    if not hasattr(receiver, "_agent_names"):
        return 0  # not the NIXL backend
    from kv_transfer.backends.nixl_notif import NotifKind, encode_notif

    agents = list(receiver._agent_names.values())

    def forge() -> None:
        rng = random.Random()
        for agent_name in agents:
            for i in range(num_claims):
                transfer_id = rng.randrange(1 << 40, 1 << 41) if i % 2 else rng.randrange(0, 64)
                claim = encode_notif(NotifKind.CLAIM, transfer_id, hold_s=5.0,
                                     connection_info=receiver._connection_info)
                receiver.agent.send_notif(agent_name, claim)

    _on_step_thread(actor, forge)
    return len(agents) * num_claims


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
