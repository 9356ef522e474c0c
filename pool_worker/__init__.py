"""The worker process every pool runs: one Ray actor, one model, one KV cache, in one of three roles."""

from pool_worker.actor import WorkerActor, WorkerInfo, WorkerPlacement, WorkerRuntime
from pool_worker.roles import Role

__all__ = ["Role", "WorkerActor", "WorkerInfo", "WorkerPlacement", "WorkerRuntime"]
