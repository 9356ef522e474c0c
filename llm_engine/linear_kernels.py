"""Every linear layer on the fastest GEMM kernel the device has, chosen by a short probe at load.

    apply_linear_kernel(model, config) → probe each distinct weight shape at 1, 16 and 256 rows with both
    kernels → each shape runs, in each band of row counts, on the kernel that won there → LinearKernelReport.
Why: on a CPU, `F.linear` sends fp32 GEMMs to MKL, whose path is slow on some CPUs (AMD: 105 GFLOP/s per
core against 268 through oneDNN with prepacked weights); bf16 `F.linear` goes to oneDNN but reorders the
weight on every call. Which kernel wins depends on the CPU, the dtype, the shape and the row count (on an
Intel with AMX, fp32 MKL wins a batch-1 decode's GEMV and loses at 16 rows), so a worker times both on its own
weights and dispatches by row count: a layer whose bands disagree keeps both copies of its weight. The
choice and the timings go into the worker's info and its metrics. On CUDA: cuBLAS through `F.linear`.
The lm_head is included (a fifth of SmolLM2's weights); its tied embedding keeps its own weight.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from llm_engine.custom_ops import register_packed_linear

logger = logging.getLogger(__name__)

# Rows per GEMM the probe times: a decode step at batch 1 and 16, a prefill chunk. Each stands for a band of
# row counts (bounds at the geometric midpoints). The lm_head sees only sampling rows (one per request),
# so its 256-row band takes the 16-row verdict.
PROBE_ROWS = (1, 16, 256)
BAND_UPPER_ROWS = (4, 64)  # rows ≤ 4: band 0; ≤ 64: band 1; more: band 2
HEAD_PROBE_ROWS = (1, 16)
PROBE_REPEATS = 3
# The batch size oneDNN's reorder is tuned for: one layout serves every row count, and 16 measured within a
# few percent of the best layout at 1, 16 and 256 rows on an AMX Intel (a 1-row layout lost up to 30% at 256).
PACK_BATCH_HINT = 16


def row_band(num_rows: int) -> int:
    """Which probed row count (index into PROBE_ROWS) a GEMM of num_rows rows is dispatched by."""
    return 0 if num_rows <= BAND_UPPER_ROWS[0] else 1 if num_rows <= BAND_UPPER_ROWS[1] else 2


class LinearKernel(StrEnum):
    AUTO = "auto"  # probe at load and keep the faster (CPU); cuBLAS on CUDA
    TORCH = "torch"  # F.linear as torch dispatches it: MKL (CPU fp32), oneDNN (CPU bf16), cuBLAS (CUDA)
    ONEDNN_PACKED = "onednn-packed"  # oneDNN with weights reordered once at load (CPU only)


def onednn_unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why oneDNN prepacked linears cannot run here, or None when they can."""
    if device.type != "cpu":
        return f"oneDNN prepacked linears are a CPU kernel; the device is {device.type}"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN has no bfloat16 kernel on this CPU"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN prepacked linears take float32 or bfloat16, not {dtype}"
    return None


class PackedLinear(nn.Module):
    """An nn.Linear whose weight oneDNN reordered once, dispatching each call by its row count: bands where
    the probe found F.linear faster keep using the plain weight."""

    def __init__(self, linear: nn.Linear, packed_bands: tuple[bool, bool, bool] = (True, True, True)) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_bands = packed_bands
        # A plain attribute, not a parameter: an opaque oneDNN tensor has no strides for state_dict or .to().
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
        # The plain weight only where some band runs on F.linear: otherwise it is freed with the nn.Linear.
        self.weight = None if all(packed_bands) else linear.weight
        self.bias = linear.bias
        self.handle = register_packed_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] → [..., out_features]
        if torch.compiler.is_compiling():  # the opaque weight stays outside the graph, behind an op
            return torch.ops.pdserve.packed_linear(x, self.handle)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and not self.packed_bands[row_band(x.numel() // self.in_features)]:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        bands = "/".join("packed" if b else "torch" for b in self.packed_bands)
        return f"in_features={self.in_features}, out_features={self.out_features}, rows 1/16/256: {bands}"


@dataclass(frozen=True)
class LinearKernelReport:
    """Which GEMM kernel a worker's linears run on, and why."""

    kernel: LinearKernel  # TORCH, or ONEDNN_PACKED when any layer runs packed
    requested: LinearKernel  # what the config asked for
    reason: str  # one line: the probe's verdict, or why there was none
    num_swapped: int  # linear layers on the packed kernel
    num_linears: int  # linear layers in the model, lm_head included
    # Probe: ms of one pass over every linear layer at each row count, all on F.linear, and as chosen.
    torch_ms: dict[int, float] = field(default_factory=dict)
    chosen_ms: dict[int, float] = field(default_factory=dict)

    @property
    def speedup(self) -> float | None:
        """Geometric mean over the probed row counts of all-F.linear time / chosen time; None without a
        probe."""
        if not self.torch_ms:
            return None
        return _geomean([self.torch_ms[m] / self.chosen_ms[m] for m in self.torch_ms])


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@dataclass
class _ShapeProbe:
    """One distinct weight shape: its first layer, how many layers share it, and seconds per probed rows."""

    layer: nn.Linear
    count: int
    is_head: bool
    torch_s: dict[int, float] = field(default_factory=dict)
    packed_s: dict[int, float] = field(default_factory=dict)

    def packed_bands(self) -> tuple[bool, bool, bool]:
        """Per band of row counts: does the packed kernel win? (The head's top band: its 16-row verdict.)"""
        wins = {rows: self.packed_s[rows] < self.torch_s[rows] for rows in self.torch_s}
        return (wins[1], wins[16], wins.get(256, wins[16]))

    def chosen_s(self, rows: int) -> float:
        return min(self.packed_s[rows], self.torch_s[rows])


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, layer) for every nn.Linear in the model, lm_head included."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]


def _best_of(fn: Callable[[], torch.Tensor]) -> float:
    fn()  # the first call of a shape builds oneDNN's primitive: not what a serving step pays
    best = math.inf
    for _ in range(PROBE_REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _probe(shapes: dict[tuple[int, int], _ShapeProbe], dtype: torch.dtype, device: torch.device) -> None:
    """Time one layer of each distinct shape with both kernels at each row count it will see."""
    with torch.inference_mode():
        for probe in shapes.values():
            layer, packed = probe.layer, PackedLinear(probe.layer)
            for rows in HEAD_PROBE_ROWS if probe.is_head else PROBE_ROWS:
                x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
                probe.torch_s[rows] = _best_of(partial(F.linear, x, layer.weight, layer.bias))
                probe.packed_s[rows] = _best_of(partial(packed, x))


def _pass_ms(shapes: dict[tuple[int, int], _ShapeProbe], seconds: Callable[[_ShapeProbe, int], float]
             ) -> dict[int, float]:
    """ms of one pass over every layer (each shape × its count) at each probed row count; the head at most
    at 16 rows (it projects sampling rows only)."""
    return {rows: 1e3 * sum(p.count * seconds(p, min(rows, 16) if p.is_head else rows)
                            for p in shapes.values())
            for rows in PROBE_ROWS}


def apply_linear_kernel(model: nn.Module, requested: LinearKernel | str, dtype: torch.dtype,
                        device: torch.device) -> LinearKernelReport:
    """Put the linear layers of `model` on the kernel `requested` names. "auto": each distinct weight
    shape, in each band of row counts, on whichever kernel the probe found faster there.

    Raises:
        ValueError: `requested` is ONEDNN_PACKED and oneDNN cannot run here (the message says why).
    """
    requested = LinearKernel(requested)
    layers = _linears(model)
    unavailable = onednn_unavailable_reason(dtype, device)
    if requested is LinearKernel.TORCH or (requested is LinearKernel.AUTO and unavailable):
        reason = "asked for" if requested is LinearKernel.TORCH else str(unavailable)
        return LinearKernelReport(LinearKernel.TORCH, requested, reason, 0, len(layers))
    if unavailable:
        raise ValueError(f"linear kernel {requested.value!r}: {unavailable}")
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[int, int], _ShapeProbe] = {}
    for _, _, layer in layers:
        key = (layer.out_features, layer.in_features)
        shapes.setdefault(key, _ShapeProbe(layer, 0, layer is head)).count += 1
    bands = dict.fromkeys(shapes, (True, True, True))
    torch_ms: dict[int, float] = {}
    chosen_ms: dict[int, float] = {}
    reason = "asked for"
    if requested is LinearKernel.AUTO:
        try:
            _probe(shapes, dtype, device)
        except RuntimeError as error:  # a oneDNN that imports but cannot run these shapes
            logger.warning("oneDNN probe failed, linears stay on F.linear: %s", error)
            return LinearKernelReport(LinearKernel.TORCH, requested, f"oneDNN probe failed: {error}", 0,
                                      len(layers))
        bands = {key: p.packed_bands() for key, p in shapes.items()}
        torch_ms = _pass_ms(shapes, lambda p, rows: p.torch_s[rows])
        chosen_ms = _pass_ms(shapes, _ShapeProbe.chosen_s)
        packed_at = ", ".join(f"{rows}: {sum(b[i] for b in bands.values())}/{len(shapes)}"
                              for i, rows in enumerate(PROBE_ROWS))
        reason = (f"probe: shapes faster packed at rows {packed_at}; a pass "
                  + "/".join(f"{torch_ms[r] / chosen_ms[r]:.2f}" for r in PROBE_ROWS) + "× F.linear's")
    num_swapped = 0
    for parent, name, layer in layers:
        layer_bands = bands[(layer.out_features, layer.in_features)]
        if any(layer_bands):
            setattr(parent, name, PackedLinear(layer, layer_bands))
            num_swapped += 1
    kernel = LinearKernel.ONEDNN_PACKED if num_swapped else LinearKernel.TORCH
    logger.info("linear kernel %s (%d of %d layers packed): %s", kernel, num_swapped, len(layers), reason)
    return LinearKernelReport(kernel, requested, reason, num_swapped, len(layers), torch_ms, chosen_ms)
