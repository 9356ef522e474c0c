"""Linear layers over integer weights (llm_engine/weight_schemes.py names the schemes), on CPU kernels inside
the compiled body.

    QuantizedWeight.read(take, prefix, quant, dtype)  a compressed-tensors layer's tensors → ints + scales
        .rows(s) / .columns(s) / cat_quantized(parts)  a tensor-parallel rank's share; q/k/v, gate/up fused
        .linear()                                      → Int8Linear, WeightOnlyLinear or DequantizedLinear
Kernels (timed on an AMX Intel, 2 threads, against oneDNN's bfloat16 GEMM of the same shape; docs/models.md):
    W8A8   oneDNN's int8 GEMM (`onednn::qlinear_pointwise`, weight packed once): each token's activations
           rounded to int8 at run time (scale = its absolute maximum / 127.5, as compressed-tensors computes
           it), the channel scales applied in the GEMM, the token's after it. 0.5-0.6x the bfloat16 GEMM's
           time on large shapes at 1, 16 and 256 rows; the rounding is plain torch code a compiled body fuses.
    W8A16  `_weight_int8pack_mm` (int8 weights, one scale per channel) up to PACKED_MAX_ROWS rows: 0.55-0.8x
    W4A16  at one row; `_weight_int4pack_mm_for_cpu` (a scale and an offset per group, the offset folding an
           asymmetric checkpoint's zero points in): 0.5-0.7x at one row. Both run 4-16x slower than
           bfloat16 from 16 rows on, so a prefill chunk (over PACKED_MAX_ROWS rows) dequantizes the weight
           from an int8 copy for the call and runs F.linear.
A shape the int4 kernel cannot tile (out_features not a multiple of 16), a torch without oneDNN, and every
non-CPU device keep the weight dequantized in the model's dtype and run F.linear: right, not faster.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from llm_engine.custom_ops import int8_gemm, packed_linear, register_int8_linear, register_packed_linear
from llm_engine.weight_schemes import LayerQuant

INT4_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu's tiles of output rows
INT4_OFFSET = 8  # unsigned nibble = signed int4 + 8 (compressed-tensors' packing; the kernel's centre)
# Rows up to which the weight-only layers run the packed kernels (decode steps); more: dequantize and GEMM.
# The crossing measured on an AMX Intel at SmolLM2-1.7B's shapes: ~24 rows (benchmarks/quant_step.py).
PACKED_MAX_ROWS = 24
# W8A8's activations enter oneDNN as uint8 = int8 + this, its zero point (Int8Linear says why).
UNSIGNED_ZERO_POINT = 128

Take = Callable[[str], torch.Tensor]  # a checkpoint tensor by name, as stored (llm_engine/lean_loader.py)


def unpack_int32(packed: torch.Tensor, num_columns: int, bits: int) -> torch.Tensor:
    """compressed-tensors' `pack_to_int32` undone for 4 or 8 bits: int32 [rows, ceil(columns * bits / 32)],
    element i of a word at bits i*bits.., stored as value + 2^(bits-1) → int8 [rows, columns]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    fields = (packed.to(torch.int32)[:, :, None] >> shifts) & ((1 << bits) - 1)  # [rows, words, 32 / bits]
    return (fields.reshape(packed.shape[0], -1)[:, :num_columns] - (1 << (bits - 1))).to(torch.int8)


@dataclass(frozen=True)
class QuantizedWeight:
    """One layer's weight as integers: values [out, in] int8 (int4 ones in [-8, 7]), scale [out, groups]
    float32 (groups = 1 per channel), zero [out, groups] int8 or None (symmetric), bias in the model's
    dtype."""

    quant: LayerQuant
    values: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bias: torch.Tensor | None
    dtype: torch.dtype  # the model's: activations and outputs

    @classmethod
    def read(cls, take: Take, prefix: str, quant: LayerQuant, dtype: torch.dtype,
             bias: torch.Tensor | None = None) -> QuantizedWeight:
        """A compressed-tensors layer's tensors: `weight` int8 + `weight_scale` (int-quantized), or
        `weight_packed` + `weight_shape` + `weight_scale` (+ `weight_zero_point`) (pack-quantized)."""
        scale = take(f"{prefix}.weight_scale").to(torch.float32)
        zero = None
        bits = quant.weight_bits
        if not quant.packed:
            values = take(f"{prefix}.weight").to(torch.int8)
        else:
            rows, columns = (int(v) for v in take(f"{prefix}.weight_shape").tolist())
            values = unpack_int32(take(f"{prefix}.weight_packed"), columns, bits)[:rows]
            if not quant.symmetric:  # packed along the output rows
                zero = unpack_int32(take(f"{prefix}.weight_zero_point").t().contiguous(), rows, bits).t()
        scale = scale.reshape(values.shape[0], -1)
        if quant.group_size is not None and scale.shape[1] * quant.group_size != values.shape[1]:
            raise ValueError(f"{prefix}: {scale.shape[1]} scales of groups of {quant.group_size} for "
                             f"{values.shape[1]} input columns")
        return cls(quant, values, scale, zero, bias, dtype)

    @property
    def out_features(self) -> int:
        return int(self.values.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.values.shape[1])

    def rows(self, rows: slice) -> QuantizedWeight:
        """Output rows `rows` (a column-parallel rank's share: q/k/v, gate/up)."""
        return replace(self, values=self.values[rows], scale=self.scale[rows],
                       zero=None if self.zero is None else self.zero[rows],
                       bias=None if self.bias is None else self.bias[rows])

    def columns(self, columns: slice) -> QuantizedWeight:
        """Input columns `columns` (a row-parallel rank's share: o, down), whole scale groups only.

        Raises:
            ValueError: the share splits a group of columns that shares one scale.
        """
        group = self.quant.group_size
        if group is None:
            return replace(self, values=self.values[:, columns])
        start, stop = columns.start or 0, self.in_features if columns.stop is None else columns.stop
        if start % group or stop % group:
            raise ValueError(f"a tensor-parallel share of columns {start}:{stop} splits the checkpoint's "
                             f"groups of {group} columns: choose a --tensor-parallel-size that keeps them "
                             "whole")
        groups = slice(start // group, stop // group)
        return replace(self, values=self.values[:, columns], scale=self.scale[:, groups],
                       zero=None if self.zero is None else self.zero[:, groups])

    def dequantized(self) -> torch.Tensor:
        """The weight in the model's dtype, as compressed-tensors' dequantize computes it."""
        values = self.values.to(torch.float32)
        if self.zero is not None:
            values = values - self.zero.to(torch.float32).repeat_interleave(self.quant.group_size or 1, 1)
        scale = self.scale if self.quant.group_size is None else self.scale.repeat_interleave(
            self.quant.group_size, 1)
        return (values * scale).to(self.dtype)

    def linear(self) -> nn.Module:
        """The layer on its kernel (llm_engine/quantized_linear.py's docstring)."""
        if self.values.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return DequantizedLinear(self)
        if self.quant.dynamic_int8_activations:
            return Int8Linear(self)
        if self.quant.weight_bits == 8 or self.out_features % INT4_OUT_MULTIPLE == 0:
            return WeightOnlyLinear(self)
        return DequantizedLinear(self)


def cat_quantized(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The parts' outputs side by side in one weight (q/k/v, gate/up: one GEMM).

    Raises:
        ValueError: the parts are quantized differently (the checkpoint's groups split a fused layer).
    """
    first = parts[0]
    if any(part.quant != first.quant for part in parts):
        raise ValueError("layers the engine fuses (q/k/v, gate/up) are quantized differently: "
                         + ", ".join(part.quant.label for part in parts))
    return replace(first, values=torch.cat([p.values for p in parts]),
                   scale=torch.cat([p.scale for p in parts]),
                   zero=None if first.zero is None else torch.cat([p.zero for p in parts]),  # type: ignore[misc]
                   bias=None if first.bias is None else torch.cat([p.bias for p in parts]))  # type: ignore[misc]


class QuantizedLinear(nn.Module):
    """What every quantized layer shares: its shape and scheme, shown by the worker's info."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.quant = weight.quant
        self.bias = None if weight.bias is None else nn.Parameter(weight.bias, requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.quant.label}"

    def _add_bias(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.bias is None else out + self.bias


def _aligned(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in torch's own 64-byte aligned memory: the packed kernels' vector loads fault on a tensor that
    starts at any offset of the checkpoint's file."""
    return tensor.clone(memory_format=torch.contiguous_format)


def quantize_per_token(x: torch.Tensor, unsigned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, columns] → (int8 values, float32 scale [rows, 1]): symmetric, scale = the row's absolute
    maximum / 127.5, as compressed-tensors' dynamic token quantization computes it. `unsigned`: the same
    values + UNSIGNED_ZERO_POINT as uint8 (what oneDNN's x86 int8 GEMM takes; see Int8Linear)."""
    x32 = x.to(torch.float32)
    scale = (x32.abs().amax(dim=-1, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).eps)
    values = (x32 / scale).round().clamp(-128, 127)
    if unsigned:
        return (values + UNSIGNED_ZERO_POINT).to(torch.uint8), scale
    return values.to(torch.int8), scale


class Int8Linear(QuantizedLinear):
    weight_scale: torch.Tensor
    weight_zero_points: torch.Tensor

    """W8A8: each token's activations rounded to int8 (quantize_per_token), an int8 × int8 GEMM in oneDNN
    (AMX / VNNI where the CPU has them) with the weight packed once and its channel scales applied inside,
    then the token's scale. The rounding and the scaling are plain torch code around one op
    (pdserve::int8_gemm), so a compiled body fuses them with the norm before and what comes after.
    The activations go in unsigned, shifted by UNSIGNED_ZERO_POINT (oneDNN subtracts it back: the same
    products to the bit): oneDNN's fast int8 kernels multiply unsigned activations by signed weights, and
    with signed activations a CPU without AMX (AVX-512 VNNI: an AMD EPYC here) runs its reference kernel,
    130× (1 row) to 2000× (256 rows) slower than bfloat16."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__(weight)
        self.dtype = weight.dtype
        # A plain attribute: an opaque oneDNN tensor (as PackedLinear's), outside state_dict and the graph.
        self.packed_weight = torch.ops.onednn.qlinear_prepack(_aligned(weight.values), None)
        self.register_buffer("weight_scale", _aligned(weight.scale[:, 0].to(torch.float32)))
        self.register_buffer("weight_zero_points", torch.zeros(self.out_features, dtype=torch.int64))
        self.handle = register_int8_linear(self)

    def int8_gemm(self, quantized_x: torch.Tensor) -> torch.Tensor:
        return torch.ops.onednn.qlinear_pointwise(
            quantized_x, 1.0, UNSIGNED_ZERO_POINT, self.packed_weight, self.weight_scale,
            self.weight_zero_points, None, 1.0, 0, torch.float32, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] → [..., out]
        quantized, scale = quantize_per_token(x.reshape(-1, self.in_features), unsigned=True)
        if torch.compiler.is_compiling():
            accumulated = int8_gemm(quantized.contiguous(), self.handle)
        else:  # the function behind the op: an op called eagerly imports dynamo (llm_engine/custom_ops.py)
            accumulated = self.int8_gemm(quantized.contiguous())
        out = (accumulated * scale).to(self.dtype)
        return self._add_bias(out.reshape(*x.shape[:-1], self.out_features))


class WeightOnlyLinear(QuantizedLinear):
    values: torch.Tensor  # int8 [out, in], zero points subtracted: what the dequantized path scales
    scale: torch.Tensor  # [out, groups] in the model's dtype (one group per channel for int8)
    packed: torch.Tensor | None  # int4: the kernel's packing
    channel_scale: torch.Tensor  # int8: [out]
    scales_and_offsets: torch.Tensor  # int4: [groups, out, 2]

    """W8A16 / W4A16: activations in the model's dtype. Up to PACKED_MAX_ROWS rows (decode steps) the packed
    weight-only kernel, which reads a quarter (int4) or half (int8) of the bfloat16 bytes; above (prefill
    chunks), where that kernel runs 4-16x slower than oneDNN's bfloat16 GEMM (benchmarks/quant_step.py), the
    weight dequantized for the call and F.linear. The choice sits inside one op (pdserve::packed_linear), so a
    compiled graph never specialises on the row count."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__(weight)
        self.dtype = weight.dtype
        self.group_size = weight.quant.group_size or weight.in_features
        self.register_buffer("scale", _aligned(weight.scale.to(weight.dtype)))
        if weight.quant.weight_bits == 8:
            self.register_buffer("values", _aligned(weight.values))
            self.register_buffer("packed", None)
            self.register_buffer("channel_scale", _aligned(weight.scale[:, 0].to(weight.dtype)))
        else:
            unsigned = (weight.values.to(torch.int32) + INT4_OFFSET).contiguous()
            self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1))
            # The kernel computes (u - 8) * scale + offset per group, u the unsigned nibble: the checkpoint's
            # (q - zero) * scale is that with offset = -zero * scale.
            offset = (torch.zeros_like(weight.scale) if weight.zero is None
                      else -weight.zero.to(torch.float32) * weight.scale)
            scales_and_offsets = torch.stack([weight.scale.t(), offset.t()], dim=-1)  # [groups, out, 2]
            self.register_buffer("scales_and_offsets", scales_and_offsets.to(weight.dtype).contiguous())
            # One byte a value for the dequantized path: unpacking nibbles costs 12x the int8 conversion (38
            # against 3 ms a 6144x2048 layer), which made a 256-token prefill of SmolLM2-1.7B 8x bfloat16's.
            # So an int4 layer holds 1.5 bytes a weight (0.75x bfloat16), not 0.5; its decode reads 0.5.
            zero = None if weight.zero is None else weight.zero.repeat_interleave(self.group_size, dim=1)
            centered = weight.values if zero is None else weight.values - zero
            self.register_buffer("values", _aligned(centered.to(torch.int8)))
        self.handle = register_packed_linear(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.handle)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features).contiguous()
        if x2.shape[0] > PACKED_MAX_ROWS:
            out = F.linear(x2, self.dequantized())
        elif self.packed is None:
            out = torch.ops.aten._weight_int8pack_mm(x2, self.values, self.channel_scale)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size,
                                                             self.scales_and_offsets)
        return self._add_bias(out.reshape(*x.shape[:-1], self.out_features))

    def dequantized(self) -> torch.Tensor:
        """The weight in the model's dtype, as compressed-tensors dequantizes it: (q - zero) * scale."""
        groups = self.values.view(self.out_features, -1, self.group_size).to(self.dtype)
        return groups.mul_(self.scale[:, :, None]).view(self.out_features, self.in_features)


class DequantizedLinear(QuantizedLinear):
    weight: torch.Tensor

    """The weight dequantized once, F.linear: a shape or device the packed kernels do not take."""

    def __init__(self, weight: QuantizedWeight) -> None:
        super().__init__(weight)
        self.register_buffer("weight", weight.dequantized())
        self.dynamic_activations = weight.quant.dynamic_int8_activations

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic_activations:
            quantized, scale = quantize_per_token(x.reshape(-1, self.in_features))
            x = (quantized.to(torch.float32) * scale).to(x.dtype).reshape(x.shape)
        return F.linear(x, self.weight, self.bias)
