"""Every linear layer on the fastest GEMM kernel the device has, chosen by a short probe at load.

    apply_linear_kernel(model, config) → probe each distinct weight shape at 1, 16 and 256 rows with every
    kernel that runs here → each shape runs, in each band of row counts, on the kernel that won there →
    LinearKernelReport.
The kernels: `F.linear` as torch dispatches it; oneDNN with the weight prepacked once; and, on AMD CPUs with
the optional extra `pdserve[zen]` installed, ZenDNN's linear (`zentorch`, as vLLM's "Zen platform" runs).
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
from llm_engine.hardware import cpu_flags, cpu_vendor

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
    AUTO = "auto"  # probe at load and keep the fastest per shape and band (CPU); cuBLAS on CUDA
    TORCH = "torch"  # F.linear as torch dispatches it: MKL (CPU fp32), oneDNN (CPU bf16), cuBLAS (CUDA)
    ONEDNN_PACKED = "onednn-packed"  # oneDNN with weights reordered once at load (CPU only)
    ZENTORCH = "zentorch"  # ZenDNN's linear (AMD CPUs, the optional extra pdserve[zen])


Bands = tuple[LinearKernel, LinearKernel, LinearKernel]  # the kernel of each band of row counts
ZEN_INSTALL = "pip install 'pdserve[zen]'"


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


def zentorch_unavailable_reason(dtype: torch.dtype, device: torch.device,
                                flags: frozenset[str] | None = None, vendor: str | None = None) -> str | None:
    """Why zentorch's linears cannot run here, or None when they can (`flags`, `vendor` injected by tests).
    It is imported only here, on an AMD CPU: vLLM too uses it only on its Zen platform."""
    if device.type != "cpu":
        return f"zentorch is a CPU kernel; the device is {device.type}"
    if (cpu_vendor() if vendor is None else vendor) != "AuthenticAMD":
        return "zentorch (ZenDNN) is for AMD CPUs"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"zentorch linears take float32 or bfloat16, not {dtype}"
    if dtype == torch.bfloat16 and "avx512_bf16" not in (cpu_flags() if flags is None else flags):
        return "zentorch's bfloat16 path needs AVX512_BF16"
    try:
        import zentorch  # noqa: F401  # registers torch.ops.zentorch
    except ImportError as error:
        return f"zentorch is not installed ({ZEN_INSTALL}): {error}"
    return None


def _onednn_packed(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _zentorch(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return torch.ops.zentorch.zentorch_linear_unary(x, layer.zen_weight, layer.bias, is_weight_prepacked=True)


def _torch(x: torch.Tensor, layer: PackedLinear) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)  # type: ignore[arg-type]  # kept wherever a band reads it


KERNEL_CALLS: dict[LinearKernel, Callable[[torch.Tensor, PackedLinear], torch.Tensor]] = {
    LinearKernel.TORCH: _torch, LinearKernel.ONEDNN_PACKED: _onednn_packed, LinearKernel.ZENTORCH: _zentorch,
}


class PackedLinear(nn.Module):
    """An nn.Linear that dispatches each call by its row count to the kernel the probe chose for that band:
    oneDNN with a weight reordered once, zentorch, or F.linear."""

    def __init__(self, linear: nn.Linear, bands: Bands = (LinearKernel.ONEDNN_PACKED,) * 3) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bands = bands
        self.calls = tuple(KERNEL_CALLS[kernel] for kernel in bands)
        # A plain attribute, not a parameter: an opaque oneDNN tensor has no strides for state_dict or .to().
        self.packed_weight = (torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_BATCH_HINT)
                              if LinearKernel.ONEDNN_PACKED in bands else None)
        # zentorch's weight reordered once and held here. Not its implicit weight cache: that one is keyed by
        # the weight's address, and handed a freed-and-reused address another model's weights (wrong tokens
        # from the first one, seen in this suite, where many engines come and go in one process).
        self.zen_weight = (torch.ops.zentorch.zentorch_weight_prepack_for_linear(linear.weight.detach())
                           if LinearKernel.ZENTORCH in bands else None)
        # The plain weight only where some band runs F.linear: otherwise it is freed with the nn.Linear.
        self.weight = linear.weight if LinearKernel.TORCH in bands else None
        self.bias = linear.bias
        self.handle = register_packed_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., in_features] → [..., out_features]
        if torch.compiler.is_compiling():  # the opaque weight stays outside the graph, behind an op
            return torch.ops.pdserve.packed_linear(x, self.handle)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.calls[row_band(x.numel() // self.in_features)](x, self)

    def extra_repr(self) -> str:
        bands = "/".join(kernel.value for kernel in self.bands)
        return f"in_features={self.in_features}, out_features={self.out_features}, rows 1/16/256: {bands}"


@dataclass(frozen=True)
class LinearKernelReport:
    """Which GEMM kernel a worker's linears run on, and why."""

    kernel: LinearKernel  # TORCH; else the kernel other than F.linear that most layer bands run on
    requested: LinearKernel  # what the config asked for
    reason: str  # one line: the probe's verdict, or why there was none
    num_swapped: int  # linear layers with some band on a kernel other than F.linear
    num_linears: int  # linear layers in the model, lm_head included
    # Probe: ms of one pass over every linear layer at each row count, all on F.linear, and as chosen.
    torch_ms: dict[int, float] = field(default_factory=dict)
    chosen_ms: dict[int, float] = field(default_factory=dict)
    kernels_in_use: tuple[LinearKernel, ...] = ()  # every kernel some layer band runs on, most used first

    @property
    def label(self) -> str:
        """What the worker's info and metrics show: the kernels other than F.linear in use, most used first
        ("onednn-packed+zentorch"), or "torch"."""
        return "+".join(k.value for k in self.kernels_in_use if k is not LinearKernel.TORCH) or "torch"

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
    seconds: dict[LinearKernel, dict[int, float]] = field(default_factory=dict)  # kernel → rows → s

    def winner(self, rows: int) -> LinearKernel:
        """The fastest kernel at `rows` (F.linear on a tie)."""
        return min(self.seconds, key=lambda k: (self.seconds[k][rows], k is not LinearKernel.TORCH))

    def bands(self) -> Bands:
        """Per band of row counts, the winner. (The head's top band: its 16-row verdict.)"""
        return (self.winner(1), self.winner(16), self.winner(16 if self.is_head else 256))

    def chosen_s(self, rows: int) -> float:
        return self.seconds[self.winner(rows)][rows]


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


def _probe(shapes: dict[tuple[int, int], _ShapeProbe], kernel: LinearKernel, dtype: torch.dtype,
           device: torch.device) -> None:
    """Time one layer of each distinct shape on `kernel` at each row count it will see."""
    with torch.inference_mode():
        for probe in shapes.values():
            layer = probe.layer
            wrapped = PackedLinear(layer, (kernel,) * 3)
            timings = probe.seconds.setdefault(kernel, {})
            for rows in HEAD_PROBE_ROWS if probe.is_head else PROBE_ROWS:
                x = torch.randn(rows, layer.in_features, dtype=dtype, device=device)
                timings[rows] = _best_of(partial(wrapped.eager_forward, x))


def _pass_ms(shapes: dict[tuple[int, int], _ShapeProbe], seconds: Callable[[_ShapeProbe, int], float]
             ) -> dict[int, float]:
    """ms of one pass over every layer (each shape × its count) at each probed row count; the head at most
    at 16 rows (it projects sampling rows only)."""
    return {rows: 1e3 * sum(p.count * seconds(p, min(rows, 16) if p.is_head else rows)
                            for p in shapes.values())
            for rows in PROBE_ROWS}


def kernel_unavailable_reason(kernel: LinearKernel, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `kernel` cannot run here, or None when it can (F.linear runs everywhere)."""
    if kernel is LinearKernel.ONEDNN_PACKED:
        return onednn_unavailable_reason(dtype, device)
    if kernel is LinearKernel.ZENTORCH:
        return zentorch_unavailable_reason(dtype, device)
    return None


def apply_linear_kernel(model: nn.Module, requested: LinearKernel | str, dtype: torch.dtype,
                        device: torch.device) -> LinearKernelReport:
    """Put the linear layers of `model` on the kernel `requested` names. "auto": each distinct weight
    shape, in each band of row counts, on whichever kernel the probe found fastest there, among those that
    run here (F.linear, oneDNN prepacked, zentorch).

    Raises:
        ValueError: `requested` names a kernel that cannot run here (the message says why).
    """
    requested = LinearKernel(requested)
    layers = _linears(model)
    if requested is LinearKernel.TORCH:
        return LinearKernelReport(LinearKernel.TORCH, requested, "asked for", 0, len(layers),
                                  kernels_in_use=(LinearKernel.TORCH,))
    if requested is not LinearKernel.AUTO:
        unavailable = kernel_unavailable_reason(requested, dtype, device)
        if unavailable:
            raise ValueError(f"linear kernel {requested.value!r}: {unavailable}")
        return _swap(layers, {}, requested, "asked for", {}, {}, fixed=requested)
    skipped = {k: r for k in (LinearKernel.ONEDNN_PACKED, LinearKernel.ZENTORCH)
               if (r := kernel_unavailable_reason(k, dtype, device))}
    candidates = [k for k in (LinearKernel.ONEDNN_PACKED, LinearKernel.ZENTORCH) if k not in skipped]
    if not candidates:
        return LinearKernelReport(LinearKernel.TORCH, requested, "; ".join(skipped.values()), 0, len(layers),
                                  kernels_in_use=(LinearKernel.TORCH,))
    head = getattr(model, "lm_head", None)
    shapes: dict[tuple[int, int], _ShapeProbe] = {}
    for _, _, layer in layers:
        key = (layer.out_features, layer.in_features)
        shapes.setdefault(key, _ShapeProbe(layer, 0, layer is head)).count += 1
    _probe(shapes, LinearKernel.TORCH, dtype, device)
    for kernel in candidates:
        try:
            _probe(shapes, kernel, dtype, device)
        except RuntimeError as error:  # a library that imports but cannot run these shapes here
            logger.warning("%s probe failed, not used: %s", kernel.value, error)
            skipped[kernel] = f"{kernel.value} probe failed: {error}"
            for probe in shapes.values():
                probe.seconds.pop(kernel, None)
    torch_ms = _pass_ms(shapes, lambda p, rows: p.seconds[LinearKernel.TORCH][rows])
    chosen_ms = _pass_ms(shapes, _ShapeProbe.chosen_s)
    wins = ", ".join(f"{rows}: " + " ".join(f"{k.value} {n}" for k, n in _band_counts(shapes, i).items())
                     for i, rows in enumerate(PROBE_ROWS))
    timed = ", ".join(k.value for k in next(iter(shapes.values())).seconds)
    reason = (f"probe of {timed}: shapes' fastest at rows {wins}; a pass "
              + "/".join(f"{torch_ms[r] / chosen_ms[r]:.2f}" for r in PROBE_ROWS) + "× F.linear's"
              + "".join(f"; {why}" for why in skipped.values()))
    bands = {key: p.bands() for key, p in shapes.items()}
    return _swap(layers, bands, requested, reason, torch_ms, chosen_ms)


def _band_counts(shapes: dict[tuple[int, int], _ShapeProbe], band: int) -> dict[LinearKernel, int]:
    counts: dict[LinearKernel, int] = {}
    for probe in shapes.values():
        kernel = probe.bands()[band]
        counts[kernel] = counts.get(kernel, 0) + 1
    return counts


def _swap(layers: list[tuple[nn.Module, str, nn.Linear]], bands: dict[tuple[int, int], Bands],
          requested: LinearKernel, reason: str, torch_ms: dict[int, float], chosen_ms: dict[int, float],
          fixed: LinearKernel | None = None) -> LinearKernelReport:
    """Wrap every layer whose bands (or `fixed`) use a kernel other than F.linear; the report."""
    num_swapped = 0
    uses: dict[LinearKernel, int] = {}
    for parent, name, layer in layers:
        layer_bands: Bands = (fixed,) * 3 if fixed else bands[(layer.out_features, layer.in_features)]
        for kernel in layer_bands:
            uses[kernel] = uses.get(kernel, 0) + 1
        if any(k is not LinearKernel.TORCH for k in layer_bands):
            setattr(parent, name, PackedLinear(layer, layer_bands))
            num_swapped += 1
    in_use = tuple(sorted(uses, key=lambda k: -uses[k]))
    kernel = next((k for k in in_use if k is not LinearKernel.TORCH), LinearKernel.TORCH)
    report = LinearKernelReport(kernel, requested, reason, num_swapped, len(layers), torch_ms, chosen_ms,
                                in_use)
    logger.info("linear kernels %s (%d of %d layers wrapped): %s", report.label, num_swapped, len(layers),
                reason)
    return report
