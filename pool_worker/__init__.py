"""The worker process every pool runs: one Ray actor, one model, one KV cache, in one of three roles.

Layers inside, from the top: `actor` (the Ray actor) → the roles (prefill_pool/, decode_pool/) → `runtime/`
(step loop, inbox, output channels, load reports, process setup) and `roles` (the Role enum) → llm_engine.
The actor is imported lazily so that the roles can import `pool_worker.runtime` without importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pool_worker.roles import Role

if TYPE_CHECKING:
    from pool_worker.actor import WorkerActor, WorkerInfo, WorkerPlacement, WorkerRuntime

__all__ = ["Role", "WorkerActor", "WorkerInfo", "WorkerPlacement", "WorkerRuntime"]


def __getattr__(name: str) -> Any:
    if name in ("WorkerActor", "WorkerInfo", "WorkerPlacement", "WorkerRuntime"):
        from pool_worker import actor

        return getattr(actor, name)
    raise AttributeError(f"module 'pool_worker' has no attribute {name!r}")
