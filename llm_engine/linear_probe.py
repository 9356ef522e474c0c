"""The probe that puts every linear layer on its fastest kernel (llm_engine/linear_kernels.py has the
kernels): time each distinct weight shape at PROBE_ROWS rows with every kernel that runs here, give each band
of row counts to the kernel that won it, swap the layers, and report the choice (LinearKernelReport)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from llm_engine.config import LinearKernel
from llm_engine.linear_kernels import (
    HEAD_PROBE_ROWS,
    PROBE_REPEATS,
    PROBE_ROWS,
    Bands,
    PackedLinear,
    kernel_unavailable_reason,
)

logger = logging.getLogger(__name__)


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
    head = getattr(head, "linear", head)  # a tensor-parallel rank's rows of it (VocabParallelHead)
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
