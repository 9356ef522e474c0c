"""Description of a worker's KV memory, and the compatibility check done before any byte moves.

The engine's KV cache is one contiguous tensor per worker:
    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
so block i is the byte range [i * block_bytes, (i + 1) * block_bytes) of that tensor.
A tensor-parallel worker whose ranks are reached one by one (NIXL) has one such tensor per rank, each with
that rank's KV heads and the same block ids: its layout describes the whole heads (what a peer's blocks must
match) and lists the ranks' slices (`KVLayout.ranks`), and a peer reads each head from the rank that holds it
(kv_transfer/head_slices.py).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import msgpack

if TYPE_CHECKING:
    import torch


class IncompatibleLayoutError(ValueError):
    """Raised when two workers' KV layouts differ beyond what a pull converts: their blocks hold other
    shapes, or elements the receiver cannot convert."""


# What must match for two workers' blocks to mean the same bytes (addresses and device kind need not).
_COMPARED_FIELDS = ("block_bytes", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype")
# What must match for a receiver to convert the blocks it pulls into its own element type: the geometry.
_GEOMETRY_FIELDS = ("num_layers", "block_size", "num_kv_heads", "head_dim")
# The element types a pull converts between (kv_transfer/conversion.py): the floats a KV cache holds.
CONVERTIBLE_DTYPES = frozenset({"float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"})


@dataclass(frozen=True)
class MemoryRegion:
    """One registered, contiguous piece of a worker's KV memory holding consecutive blocks."""

    address: int  # virtual address of the region's first byte in the owning process
    num_bytes: int  # length of the region in bytes
    device_id: int  # CUDA device ordinal, 0 for host memory
    first_block: int  # id of the block that starts at `address`


@dataclass(frozen=True)
class RankSlice:
    """The KV heads [first_kv_head, first_kv_head + num_kv_heads) of every layer, held by one rank of a
    tensor-parallel worker in blocks of its own ([layers, 2, block_size, num_kv_heads, head_dim])."""

    rank: int  # the rank within its worker; 0 is the one the worker's transfer endpoints live in
    first_kv_head: int
    num_kv_heads: int
    region: MemoryRegion  # the rank's whole cache, in the rank's process


@dataclass(frozen=True)
class KVLayout:
    """What a peer must know about a worker's KV memory to read or write its blocks."""

    num_blocks: int  # number of blocks in the worker's cache
    block_bytes: int  # bytes per block (all layers, K and V)
    num_layers: int  # transformer layers held in each block
    block_size: int  # tokens per block
    num_kv_heads: int  # KV heads per layer
    head_dim: int  # elements per head
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    device: str  # "cpu" or "cuda"; the memory kind, not the ordinal
    regions: tuple[MemoryRegion, ...]  # where the blocks lie; one region for the engine's single tensor
    # Empty: one process holds every head, in `regions`. Else a tensor-parallel worker's ranks, in rank order,
    # each holding a slice of the heads (`regions` is then empty: no process holds whole-head blocks).
    ranks: tuple[RankSlice, ...] = ()

    @property
    def fingerprint(self) -> str:
        """Short hash of everything that must match for a byte-for-byte block copy (not addresses, device)."""
        key = [getattr(self, name) for name in _COMPARED_FIELDS]
        return hashlib.sha1(msgpack.packb(key)).hexdigest()[:16]

    def block_address(self, block_id: int) -> int:
        """Virtual address of block `block_id`.

        Args:
            block_id: a block id in [0, num_blocks).

        Returns:
            The address of the block's first byte.
        """
        for region in self.regions:
            offset = (block_id - region.first_block) * self.block_bytes
            if 0 <= offset < region.num_bytes:
                return region.address + offset
        raise IndexError(f"block {block_id} is outside the registered regions ({self.num_blocks} blocks)")


def layout_from_tensor(kv_cache: torch.Tensor) -> KVLayout:
    """Describe an engine KV cache tensor.

    Args:
        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], contiguous.

    Returns:
        Its layout, with one memory region covering the whole tensor.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(f"kv_cache must be [blocks, layers, 2, block_size, kv_heads, head_dim], got "
                         f"{tuple(kv_cache.shape)}")
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be contiguous: blocks are moved as byte ranges")
    num_blocks, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    region = MemoryRegion(
        address=kv_cache.data_ptr(),
        num_bytes=num_blocks * block_bytes,
        device_id=max(kv_cache.get_device(), 0),
        first_block=0,
    )
    return KVLayout(
        num_blocks=num_blocks,
        block_bytes=block_bytes,
        num_layers=num_layers,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=str(kv_cache.dtype).removeprefix("torch."),
        device=kv_cache.device.type,
        regions=(region,),
    )


def rank_slices_layout(rank_caches: list[tuple[int, int, MemoryRegion]], rank0: KVLayout) -> KVLayout:
    """The layout of a tensor-parallel worker whose ranks are read one by one.

    Args:
        rank_caches: per rank, in rank order: (first KV head, KV heads, its cache's region).
        rank0: layout_from_tensor of rank 0's cache (its geometry; the heads are widened to all of them).

    Returns:
        The whole-head layout (its fingerprint matches a one-rank worker's) with the ranks' slices.
    """
    slices = tuple(RankSlice(rank, first, num, region)
                   for rank, (first, num, region) in enumerate(rank_caches))
    num_kv_heads = max(s.first_kv_head + s.num_kv_heads for s in slices)
    per_head = rank0.block_bytes // rank0.num_kv_heads
    return replace(rank0, num_kv_heads=num_kv_heads, block_bytes=per_head * num_kv_heads, regions=(),
                   ranks=slices)


def layout_slices(layout: KVLayout) -> tuple[RankSlice, ...]:
    """Which ranks hold which heads: a tensor-parallel layout's slices, or one slice of every head."""
    if layout.ranks:
        return layout.ranks
    if len(layout.regions) != 1:
        raise ValueError(f"a one-rank layout with {len(layout.regions)} regions has no single slice")
    return (RankSlice(0, 0, layout.num_kv_heads, layout.regions[0]),)


def check_compatible(source: KVLayout, destination: KVLayout) -> None:
    """Refuse a pull between layouts whose blocks neither mean the same bytes nor convert: the geometry
    must match, and the element types be equal or both in CONVERTIBLE_DTYPES (see converts()).

    Args:
        source: layout of the worker that holds the blocks.
        destination: layout of the worker that receives them.

    Raises:
        IncompatibleLayoutError: naming every field that differs.
    """
    if source.fingerprint == destination.fingerprint:
        return
    fields = _GEOMETRY_FIELDS if converts(source, destination) else _COMPARED_FIELDS
    diffs = [f"{name}: source {getattr(source, name)!r} != destination {getattr(destination, name)!r}"
             for name in fields if getattr(source, name) != getattr(destination, name)]
    if diffs:
        raise IncompatibleLayoutError("incompatible KV layouts, refusing the transfer: " + "; ".join(diffs))


def converts(source: KVLayout, destination: KVLayout) -> bool:
    """Whether a pull from `source` into `destination` converts its elements (bfloat16 → fp8 and back):
    they differ in type and both types convert. The receiver then reads the source's bytes into a staging
    buffer and writes them into its cache in its own type (kv_transfer/conversion.py)."""
    return (source.dtype != destination.dtype and source.dtype in CONVERTIBLE_DTYPES
            and destination.dtype in CONVERTIBLE_DTYPES)


def check_block_ids(layout: KVLayout, block_ids: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless every id lies in [0, layout.num_blocks).

    Args:
        layout: the layout the ids index.
        block_ids: the ids to check.
        what: name used in the message ("source", "destination").
    """
    bad = [b for b in block_ids if not 0 <= b < layout.num_blocks]
    if bad:
        raise ValueError(f"{what} block ids out of range [0, {layout.num_blocks}): {bad[:8]}")


def coalesce_runs(src_ids: tuple[int, ...], dst_ids: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Group block pairs into runs that are consecutive on both sides, so each run is one copy.

    Args:
        src_ids: source block ids.
        dst_ids: destination block ids, same length.

    Returns:
        (src_start, dst_start, num_blocks) per run, in order.
    """
    runs: list[tuple[int, int, int]] = []
    for src, dst in zip(src_ids, dst_ids, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs
