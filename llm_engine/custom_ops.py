"""The engine's opaque ops, the only calls a compiled model body does not trace into.

    with step_context(metadata):    # the runner, around one forward
        body(input_ids, positions)  # each layer → pdserve::paged_attention(q, k, v, layer, scale)
                                    #            → pdserve::packed_linear(x, handle) (CPU, oneDNN prepacked;
                                    #              integer weight-only layers)
                                    #            → pdserve::int8_gemm(xq, handle) (W8A8's oneDNN int8 GEMM)
                                    #            → pdserve::tp_all_reduce(x, group) (tensor parallel ranks)
Why ops: inductor fuses the plain torch code between them (norms, rotary, SiLU·mul, residual adds) and sees
each op as one call with a known output shape (its fake), so the graph never breaks on the paged attention's
Python control flow (prefill segments, the decode batch) nor on oneDNN's opaque prepacked weights. The
attention's per-forward metadata is not an argument: it lives in a step context the runner sets around each
forward (as vLLM's forward context does), so the compiled graph has no guards on it and never recompiles
because a batch changed shape. With no context set (the compile warm-up), the attention returns zeros: the
warm-up traces and compiles, it computes nothing anyone reads; likewise the all-reduce skips its collective
then (ranks compile on their own; a collective in one rank's warm-up would wait for the others forever).
Eager bodies call the functions behind the ops directly: an op called eagerly goes through torch's
dispatcher, whose first call imports torch._dynamo (1.2 CPU-s, 0.75 s of a worker's first step).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

import torch

from llm_engine.tp_groups import group_by_handle

if TYPE_CHECKING:
    from llm_engine.paged_attention import PagedAttentionMetadata


class EagerLinear(Protocol):
    """What the op needs of a layer (llm_engine/linear_kernels.py PackedLinear, which imports this module)."""

    out_features: int

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor: ...


class Int8Gemm(Protocol):
    """What the int8 op needs of a layer (llm_engine/quantized_linear.py Int8Linear)."""

    out_features: int

    def int8_gemm(self, quantized_x: torch.Tensor) -> torch.Tensor: ...


class _StepState(threading.local):
    # Per thread: a body compiled beside serving warms up on its own thread (no context: attention computes
    # nothing) while the worker's step thread runs forwards in theirs (llm_engine/compilation.py).
    metadata: PagedAttentionMetadata | None = None


_step = _StepState()
# Packed linears by handle. Weak: an engine's layers go when it goes (tests build many in one process).
_packed_linears: weakref.WeakValueDictionary[int, EagerLinear] = weakref.WeakValueDictionary()
_int8_linears: weakref.WeakValueDictionary[int, Int8Gemm] = weakref.WeakValueDictionary()
_next_handle = 0


@contextmanager
def step_context(metadata: PagedAttentionMetadata | None) -> Iterator[None]:
    """Make `metadata` the one every paged_attention call of this forward reads."""
    previous, _step.metadata = _step.metadata, metadata
    try:
        yield
    finally:
        _step.metadata = previous


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    """query: [T, H, D] after rotary; key/value: [T, KVH, D] → [T, H, D]. Writes key/value into the step's KV
    cache slots (the cache is the context's, not an argument: no functionalization copies of it)."""
    if torch.compiler.is_compiling():
        return _paged_attention_op(query, key, value, layer, scale)
    return _attend_in_step(query, key, value, layer, scale)


def _attend_in_step(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    from llm_engine.paged_attention import attend

    metadata = _step.metadata
    if metadata is None:  # the compile warm-up: nothing to attend to
        return torch.zeros_like(query)
    return attend(query, key, value, layer, metadata, scale)


_paged_attention_op = torch.library.custom_op("pdserve::paged_attention", _attend_in_step, mutates_args=())


@_paged_attention_op.register_fake
def _paged_attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                          scale: float) -> torch.Tensor:
    return torch.empty_like(query)


def register_packed_linear(layer: EagerLinear) -> int:
    """A handle the compiled graph names `layer` by (an opaque oneDNN weight cannot be a graph input)."""
    handle = _new_handle()
    _packed_linears[handle] = layer
    return handle


def _new_handle() -> int:
    global _next_handle
    handle, _next_handle = _next_handle, _next_handle + 1
    return handle


@torch.library.custom_op("pdserve::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x: [..., in_features] → [..., out_features] through the registered PackedLinear `handle`."""
    return _packed_linears[handle].eager_forward(x)


@packed_linear.register_fake
def _packed_linear_fake(x: torch.Tensor, handle: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _packed_linears[handle].out_features)


def register_int8_linear(layer: Int8Gemm) -> int:
    """A handle the compiled graph names an int8 layer by (its oneDNN-packed weight is opaque too)."""
    handle = _new_handle()
    _int8_linears[handle] = layer
    return handle


@torch.library.custom_op("pdserve::int8_gemm", mutates_args=())
def int8_gemm(quantized_x: torch.Tensor, handle: int) -> torch.Tensor:
    """int8 [rows, in_features] → float32 [rows, out_features]: Σ x·w times each output channel's weight scale
    (the token's scale is applied outside the op, where inductor fuses it with what follows)."""
    return _int8_linears[handle].int8_gemm(quantized_x)


@int8_gemm.register_fake
def _int8_gemm_fake(quantized_x: torch.Tensor, handle: int) -> torch.Tensor:
    out_features = _int8_linears[handle].out_features
    return quantized_x.new_empty(quantized_x.shape[0], out_features, dtype=torch.float32)


def tp_all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    """x summed over the ranks of tensor-parallel group `group` (llm_engine/tensor_parallel.py)."""
    if torch.compiler.is_compiling():
        return _tp_all_reduce_op(x, group)
    return _all_reduce_in_step(x, group)


def _all_reduce_in_step(x: torch.Tensor, group: int) -> torch.Tensor:
    out = x.contiguous().clone()
    if _step.metadata is not None:  # not the compile warm-up
        group_by_handle(group).all_reduce(out)
    return out


_tp_all_reduce_op = torch.library.custom_op("pdserve::tp_all_reduce", _all_reduce_in_step, mutates_args=())


@_tp_all_reduce_op.register_fake
def _tp_all_reduce_fake(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x)
