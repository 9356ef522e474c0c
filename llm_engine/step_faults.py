"""Whose fault a failed step is: the requests in its batch, or the worker itself.

A step that raises makes the requests in its batch suspects (one of them may be a "query of death" that breaks
every forward it is in). Some errors say nothing about the batch: the allocator ran out of memory, a
collective of the tensor-parallel group failed because a rank died. Blaming the batch for those would slow
innocent streams on the next worker for nothing, so they make no suspects.
"""

from __future__ import annotations

import torch
import torch.distributed

# Messages of errors that torch raises as a plain RuntimeError when a peer rank is gone (gloo: the socket
# closed; NCCL: a communicator aborted or timed out) or memory ran out outside torch's own OOM type.
_WORKER_FAULT_MARKERS = ("connection closed by peer", "connection reset by peer", "gloo", "nccl",
                         "out of memory", "collective", "communicator")


class WorkerFault(RuntimeError):
    """A fault of the worker itself found outside a step (a tensor-parallel rank gone while it idled)."""


def is_worker_fault(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is the worker's own: memory, or its tensor-parallel group."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, (WorkerFault, torch.OutOfMemoryError, MemoryError, torch.distributed.DistError)):
            return True
        message = str(cause).lower()
        if any(marker in message for marker in _WORKER_FAULT_MARKERS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False
