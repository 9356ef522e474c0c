"""What the device runs natively: the dtype `auto` picks, read from the CPU's flags or the CUDA device.

`--dtype auto` (the default, as in vLLM) is bfloat16 where the hardware computes it natively and float32
elsewhere: on a CPU, native means AVX512_BF16 or AMX-BF16 (without them torch emulates bf16 in fp32 and is
no faster, measured on an AVX2-only AMD); on CUDA, any device that runs bf16 (float16 on older ones).
"""

from __future__ import annotations

from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
# CPU flags (as /proc/cpuinfo names them) that mean the cores compute bf16 natively.
NATIVE_BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags() -> frozenset[str]:
    """The first core's flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    path = Path("/proc/cpuinfo")
    if not path.is_file():
        return frozenset()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool(NATIVE_BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags))


def resolve_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """The concrete dtype name for `dtype` on `device` ("auto" resolved; `flags` injected by tests).

    Raises:
        ValueError: an unknown name, or float16 on a CPU.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    is_cuda = device.startswith("cuda")
    if dtype == "float16" and not is_cuda:
        raise ValueError("dtype float16 runs on CUDA only; on a CPU use auto, bfloat16 or float32")
    if dtype != "auto":
        return dtype
    if is_cuda:
        # The gateway may resolve this on a node without the GPU: assume a current one (bf16) there.
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "float16"
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16(flags) else "float32"
