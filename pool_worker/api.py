"""What the gateway needs of the worker side, torch-free: the worker actor's class (by its import path,
loaded only in the process that creates workers) and the errors its calls raise. A frontend process imports
this, never pool_worker.actor: that brings the roles, the engine, tensor parallelism and torch.
"""

from __future__ import annotations

import importlib

WORKER_ACTOR_CLASS = "pool_worker.actor.WorkerActor"  # every worker of every role is one of these


def worker_actor_class() -> type:
    """The worker actor's class (pool_worker.actor.WorkerActor), imported on first call: it loads the
    roles, the engine and torch, which only the process that creates workers needs."""
    module, name = WORKER_ACTOR_CLASS.rsplit(".", 1)
    cls: type = getattr(importlib.import_module(module), name)
    return cls


class WrongRole(RuntimeError):
    """A call meant for another role reached this worker."""


class StillHoldsWork(RuntimeError):
    """set_role() refused: the worker holds requests or KV blocks (a submission landed after the fleet saw
    it empty); nothing changed: drain it again, then ask again."""


class WorkerFailed(RuntimeError):
    """The worker's step loop died; it serves nothing more (the gateway replaces the worker)."""
