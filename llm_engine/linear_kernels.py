"""Every linear layer on the fastest GEMM kernel the device has, chosen by a short probe at load (the
kernels and their availability here; the probe in llm_engine/linear_probe.py).

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
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from llm_engine.config import LinearKernel
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


def kernel_unavailable_reason(kernel: LinearKernel, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `kernel` cannot run here, or None when it can (F.linear runs everywhere)."""
    if kernel is LinearKernel.ONEDNN_PACKED:
        return onednn_unavailable_reason(dtype, device)
    if kernel is LinearKernel.ZENTORCH:
        return zentorch_unavailable_reason(dtype, device)
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
