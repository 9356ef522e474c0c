"""Tensor-parallel groups by handle: the compiled graph names a group by an int (a process group cannot be a
graph input). A leaf: the all-reduce op (llm_engine/custom_ops.py) finds its group here without importing
llm_engine/tensor_parallel.py, whose groups register themselves here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class AllReduceGroup(Protocol):
    """What the op needs of a group (llm_engine/tensor_parallel.py TPGroup)."""

    def all_reduce(self, tensor: torch.Tensor) -> None: ...


_groups: dict[int, AllReduceGroup] = {}


def register_group(group: AllReduceGroup) -> int:
    handle = len(_groups)
    _groups[handle] = group
    return handle


def group_by_handle(handle: int) -> AllReduceGroup:
    return _groups[handle]
