"""What each transfer backend declares it needs from the orchestration (after Ray Serve LLM's KV connectors):
a leaf both the registry and the sender/receiver bases read, so neither imports the other.

    needs_peer_bound_up_front  the peer set is fixed when the backend starts (torch process-group ranks),
                               instead of peers being added at any time through add_peer() (nixl, local)
    sender_takes_part          each pull needs the caller to carry PullRequest -> accept_pull -> PullReply,
                               instead of the backend reaching the sender itself (nixl: a claim notification
                               answered in sender.poll(), then a READ; local: a copy)
    reads_rank_slices          a tensor-parallel worker's ranks take part one by one: each rank's cache is
                               registered where it lives and a pull reads every head from the rank that holds
                               it (kv_transfer/head_slices.py) (nixl), instead of whole-head blocks staged in
                               rank 0's process (torch, local: llm_engine/tensor_parallel.py)
Callers orchestrate by the flags, never by the backend's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.enums import BackendName


@dataclass(frozen=True)
class BackendCapabilities:
    """What the orchestration must do differently for a backend."""

    needs_peer_bound_up_front: bool  # peers fixed at start (ranks of a group) rather than added any time
    sender_takes_part: bool  # each pull needs a PullRequest/PullReply round trip through the sender
    crosses_processes: bool  # sender and receiver may live in different processes (or hosts)
    reads_rank_slices: bool = False  # a tensor-parallel worker's ranks read and are read one by one


CAPABILITIES: dict[BackendName, BackendCapabilities] = {
    BackendName.LOCAL: BackendCapabilities(needs_peer_bound_up_front=False, sender_takes_part=False,
                                           crosses_processes=False),
    BackendName.NIXL: BackendCapabilities(needs_peer_bound_up_front=False, sender_takes_part=False,
                                          crosses_processes=True, reads_rank_slices=True),
    BackendName.TORCH: BackendCapabilities(needs_peer_bound_up_front=True, sender_takes_part=True,
                                           crosses_processes=True),
}
