"""Tensor parallelism inside one worker: its ranks are processes that each hold a slice of every layer's
heads and MLP, and step together.

    bind_group_address(host, size) on rank 0 → init_method; TPGroup(TPRank(rank, size, init_method)) on every
        rank → a gloo group over a TCP store of its own (the step
        broadcast; on a CPU also the all-reduces) and, on CUDA, an NCCL group beside it for the all-reduces
    Megatron-style slices: q/k/v and gate/up column-parallel (each rank its heads and its share of the MLP),
        o and down row-parallel, their partial sums added over the ranks (pdserve::tp_all_reduce); embeddings
        and norms whole on every rank; the lm_head split by vocabulary rows (VocabParallelHead: each rank
        projects onto its rows, rank 0 gathers the logits: the only rank that samples). A rank reads only
        its slice from the checkpoint (llm_engine/lean_loader.py, then join_group); a body that
        transformers loaded whole is sliced in place (shard_lean_body): llm_engine/tp_sharding.py. The
        shares need not be equal (rank_shares): 3 KV heads over 2 ranks are 2 + 1, each with its KV heads'
        query heads, so SmolLM2 (9 heads, 3 KV heads) splits over 2 ranks as well as 3; a step waits for the
        larger share
    rank 0: an LLMEngine as ever (scheduler, sampling); its ModelRunner mirrors each call that reads
        or writes the KV cache or the runner's block tables (StepMirror.send: execute, copy_blocks,
        forget_all) to the other ranks, under one lock so the collectives of two calls never interleave
    ranks > 0: TPFollower.serve() replays each mirrored call over its own slice until Stop (an Execute: the
        forward, then the lm_head calls rank 0's makes, each a gather).
KV that leaves or arrives (a prefill's handoff, a pull, a stream's migration), two ways, by the transfer
backend (EngineConfig.tp_staging), so that a worker of any degree hands KV to a worker of any other through
the same handles, leases and layout checks as one-rank workers:
    rank slices (NIXL): every rank's cache is registered where it lives; a peer reads each head from the rank
        that holds it and each receiving rank reads its own (kv_transfer/head_slices.py). The transfer layer
        reaches the other ranks through RankCall, an op for their rank_handler answered with gather_objects.
    rank 0 staging (torch, local: one process sends and receives): the transfer layer sees one whole-head
        cache, rank 0's staging cache (as many blocks as each rank's cache, all the heads). Before an offer
        rank 0 gathers every rank's heads of the blocks into it (GatherBlocks); after a pull it scatters them
        to the ranks (ScatterBlocks). The price: rank 0 holds a whole-head copy of the cache's size (from
        the same KV budget), and the bytes cross the group once more.
Why rank 0 alone schedules and samples: one schedule and one token per request, nothing to agree on; the
other ranks need only the batch, and after the last all-reduce the hidden states are whole on every rank.
A rank that dies: the others' next collective fails (gloo: the peer's socket closes; NCCL: the timeout), the
step loop raises, and the worker goes down as one unit, as any worker whose step failed.
The group has its own store and never touches torch.distributed's default group, which the torch transfer
backend owns (kv_transfer/backends/torch_group.py).
"""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from llm_engine.batch import ModelInput
from llm_engine.tp_groups import register_group

# How long an all-reduce waits for a slow rank before the step fails. The step broadcast has no such
# bound: ranks > 0 wait there while the worker is idle, for as long as that lasts.
ALL_REDUCE_TIMEOUT = timedelta(seconds=120)
IDLE_TIMEOUT = timedelta(days=365)


@dataclass(frozen=True)
class TPRank:
    """Where one rank of a worker's tensor-parallel group meets the others."""

    rank: int
    size: int
    init_method: str  # "tcp://host:port": rank 0 serves the group's store there
    backend: str = "gloo"  # "nccl": the all-reduces on CUDA (the step broadcast stays on gloo)


# Rank 0's stores bound by bind_group_address, by init_method, until its TPGroup takes its own.
_bound_stores: dict[str, Any] = {}


def bind_group_address(host: str, size: int) -> str:
    """Where a group of `size` ranks will meet on `host`: rank 0's store, listening already on a port it chose
    itself, kept for rank 0's TPGroup. Returns the group's init_method. (A port found free and bound later
    can be taken in between: seen, EADDRINUSE, with a test suite's processes starting around it.)"""
    store = dist.TCPStore(host, 0, size, is_master=True, timeout=timedelta(seconds=300),
                          wait_for_workers=False)
    init_method = f"tcp://{f'[{host}]' if ':' in host else host}:{store.port}"
    _bound_stores[init_method] = store
    return init_method


class TPGroup:
    """One worker's ranks: the step broadcast (gloo) and the all-reduce (gloo, or NCCL on CUDA)."""

    def __init__(self, rank: TPRank) -> None:
        url = urlparse(rank.init_method)
        if url.scheme != "tcp" or url.hostname is None or url.port is None:
            raise ValueError(f"a tensor-parallel group meets at tcp://host:port, got {rank.init_method!r}")
        self.rank, self.size = rank.rank, rank.size
        store = _bound_stores.pop(rank.init_method, None) if rank.rank == 0 else None
        if store is None:
            store = dist.TCPStore(url.hostname, url.port, rank.size, is_master=rank.rank == 0,
                                  timeout=timedelta(seconds=300))
        self._store = store  # the groups keep using it
        # Typed Any: torch's stubs miss the backends' own collectives (broadcast(tensor, root)).
        self._control: Any = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank.rank, rank.size,
                                                   IDLE_TIMEOUT)
        reduce_store = dist.PrefixStore("reduce", store)
        self._reduce: Any = (
            _nccl_group(reduce_store, rank.rank, rank.size) if rank.backend == "nccl" else
            dist.ProcessGroupGloo(reduce_store, rank.rank, rank.size, ALL_REDUCE_TIMEOUT))
        self.handle = register_group(self)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over the ranks, in place."""
        self._reduce.allreduce([tensor]).wait()

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on each: pad a smaller share), in rank order, on rank 0; [] on
        the others."""
        options = dist.GatherOptions()
        options.rootRank = 0
        tensor = tensor.contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(self.size)] if self.rank == 0 else []
        self._reduce.gather([gathered] if self.rank == 0 else [], [tensor], options).wait()
        return gathered

    def scatter_from_first(self, chunks: list[torch.Tensor], out: torch.Tensor) -> None:
        """Rank r's `out` = rank 0's chunks[r] (rank 0 gives one chunk per rank; the others give [])."""
        options = dist.ScatterOptions()
        options.rootRank = 0
        given = [[c.contiguous() for c in chunks]] if self.rank == 0 else []
        self._reduce.scatter([out], given, options).wait()

    def gather_objects(self, obj: object) -> list[object]:
        """Every rank's `obj`, in rank order, on rank 0; [] on the others (pickled; sizes first)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._control.allgather([sizes], [torch.tensor([len(data)], dtype=torch.int64)]).wait()
        longest = int(max(size[0] for size in sizes))
        payload = torch.zeros(longest, dtype=torch.uint8)
        payload[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else payload[:0]
        options = dist.GatherOptions()
        options.rootRank = 0
        gathered = [torch.empty_like(payload) for _ in range(self.size)] if self.rank == 0 else []
        self._control.gather([gathered] if self.rank == 0 else [], [payload], options).wait()
        if self.rank != 0:
            return []
        return [pickle.loads(part[:int(size[0])].numpy().tobytes())
                for part, size in zip(gathered, sizes, strict=True)]

    def broadcast_object(self, obj: object | None = None) -> object:
        """Rank 0 sends `obj`; every rank returns it (ranks > 0 wait for it, without a deadline)."""
        size = torch.zeros(1, dtype=torch.int64)
        data = b""
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(data)
        self._control.broadcast(size, 0).wait()
        payload = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0
                   else torch.empty(int(size[0]), dtype=torch.uint8))
        self._control.broadcast(payload, 0).wait()
        return obj if self.rank == 0 else pickle.loads(payload.numpy().tobytes())


def _nccl_group(store: Any, rank: int, size: int) -> Any:
    """NCCL over this group's store, on the device Ray gave this rank (CUDA builds only)."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = ALL_REDUCE_TIMEOUT
    return dist.ProcessGroupNCCL(store, rank, size, options)


# --- the step mirror: rank 0's runner calls, replayed by the other ranks ---


@dataclass(frozen=True)
class StartFollowers:
    """Rank 0's KV cache size, sent once its engine planned it: every rank allocates as many blocks."""

    num_blocks: int


@dataclass(frozen=True)
class Execute:
    batch: ModelInput


@dataclass(frozen=True)
class CopyBlocks:
    pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class GatherBlocks:
    """Every rank's heads of these blocks into rank 0's whole-head staging cache (KV about to leave)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ScatterBlocks:
    """Rank 0's staging cache's blocks split by heads into every rank's cache (KV that arrived)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ForgetAll:
    pass


@dataclass(frozen=True)
class RankCall:
    """An op for the other ranks' rank_handler (the transfer layer's: kv_transfer/backends/nixl_ranks.py);
    each answers through gather_objects, a RankCallFailed if its handler raised."""

    op: object


@dataclass(frozen=True)
class RankCallFailed:
    error: str


@dataclass(frozen=True)
class Stop:
    pass


MirroredCall = (StartFollowers | Execute | CopyBlocks | GatherBlocks | ScatterBlocks | ForgetAll | RankCall
                | Stop)


class StepMirror:
    """Rank 0's side: sends each call to the other ranks before running it itself. Hold `lock` from the send
    to the end of the call: the ranks' collectives must come in the same order on every rank."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.lock = threading.Lock()

    def send(self, call: MirroredCall) -> None:
        self.group.broadcast_object(call)

    def receive(self) -> MirroredCall:
        call = self.group.broadcast_object()
        assert isinstance(call, MirroredCall), call
        return call
