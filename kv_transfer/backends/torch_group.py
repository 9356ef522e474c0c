"""The torch.distributed group the torch KV backend moves blocks over: which p2p backend a KV cache's device
needs (NCCL for CUDA, gloo for CPU), the check that a group uses it, and the warm-up of every pair of ranks
right after the group starts."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kv_transfer.registry import BackendUnavailableError


def p2p_backend(device: str | torch.device) -> str:
    """The torch.distributed backend that moves KV blocks living on `device`: NCCL for CUDA, gloo for CPU.

    Args:
        device: the KV cache's device ("cpu", "cuda", "cuda:1" or a torch.device).

    Returns:
        "nccl" or "gloo", to pass to init_process_group
        (worker_runtime.worker_setup.TorchGroupSpec.backend).
    """
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"the torch KV transfer backend supports cpu and cuda KV caches, not {device_type}")


def warm_up_pairs(rank: int, world_size: int, device: str | torch.device) -> None:
    """Open the connection of every pair of ranks once, right after the group starts.

    NCCL builds a pair's p2p connection lazily, on that pair's first send/recv, and the first `isend`
    blocks until the peer joins it (PyTorch issues 136248, 108378). A pull posts its irecv only after the
    sender's reply, so without this the first NCCL pull between two workers deadlocks. Every rank must call
    it (a collective). Pairs go in lexicographic order: the smallest pair not yet done is the next one for
    both of its ranks, so the exchange cannot deadlock.
    """
    for low in range(world_size):
        for high in range(low + 1, world_size):
            if rank not in (low, high):
                continue
            peer = high if rank == low else low
            outgoing = torch.full((1,), rank, dtype=torch.int32, device=device)
            incoming = torch.empty(1, dtype=torch.int32, device=device)
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, outgoing, peer),
                                                dist.P2POp(dist.irecv, incoming, peer)]):
                work.wait()
            if int(incoming.item()) != peer:
                raise RuntimeError(f"torch group warm-up: rank {rank} got {int(incoming.item())} from {peer}")


def check_group_backend(backend_config: str, device: str | torch.device) -> None:
    """Refuse a process group that would move `device` tensors with the wrong backend (e.g. gloo for CUDA).

    Args:
        backend_config: dist.get_backend_config(group), e.g. "cpu:gloo,cuda:gloo" or "cuda:nccl".
        device: the KV cache's device.

    Raises:
        BackendUnavailableError: the group has no backend, or another one, for that device.
    """
    device_type = torch.device(device).type
    by_device = dict(entry.split(":", 1) for entry in backend_config.split(","))
    needed = p2p_backend(device_type)
    if by_device.get(device_type) != needed:
        raise BackendUnavailableError(
            f"the torch KV transfer backend needs {needed} for a {device_type} KV cache, but the process "
            f"group uses {backend_config!r}; initialise it with backend={needed!r}")


def require_group(group: Any, kv_cache: torch.Tensor) -> None:
    """Refuse to build an endpoint without an initialised group using the right backend."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the torch backend needs torch.distributed.init_process_group() first")
    check_group_backend(dist.get_backend_config(group), kv_cache.device)
