"""What the device offers: the dtype `auto` picks (read from the CPU's flags or the CUDA device), and its
memory (what llm_engine/kv_sizing.py sizes the KV cache from).

`--dtype auto` (the default, as in vLLM) is bfloat16 where the hardware computes it natively and float32
elsewhere: on a CPU, native means AVX512_BF16 or AMX-BF16 (without them torch emulates bf16 in fp32 and is
no faster, measured on an AVX2-only AMD); on CUDA, any device that runs bf16 (float16 on older ones).
torch is imported only where a CUDA device is asked about: the gateway checks its flags with this module.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from dataclasses import dataclass
from pathlib import Path

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # each the name of its torch dtype
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
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


def cpu_vendor() -> str:
    """The CPU's vendor id from /proc/cpuinfo ("AuthenticAMD", "GenuineIntel"; "" where there is none)."""
    path = Path("/proc/cpuinfo")
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return ""


def cpu_has_native_bf16(flags: frozenset[str] | None = None) -> bool:
    return bool(NATIVE_BF16_CPU_FLAGS & (cpu_flags() if flags is None else flags))


DEVICE_CHOICES = ("auto", "cpu", "cuda")


def sees_cuda() -> bool:
    """Whether this process sees a CUDA GPU. A CPU build of torch (its version "+cpu") sees none: answered
    without importing torch (1.4 s) where nothing has imported it yet. (kv_transfer/registry.py reads the
    build the same way for nixl: the two packages import neither each other.)"""
    if "torch" not in sys.modules and importlib.metadata.version("torch").endswith("+cpu"):
        return False
    import torch

    return torch.cuda.is_available()


def resolve_device(device: str, cuda_visible: bool | None = None) -> str:
    """The concrete device for `device`: "auto" is "cuda" where this process sees a GPU, else "cpu"
    (`cuda_visible` injected by tests; None: ask torch).

    Raises:
        ValueError: not "auto", "cpu", "cuda" or "cuda:N".
    """
    if device == "auto":
        return "cuda" if (sees_cuda() if cuda_visible is None else cuda_visible) else "cpu"
    if device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        return device
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")


def check_device_present(device: str, cuda_visible: bool | None = None) -> None:
    """Raises ValueError naming --device when `device` is CUDA and no GPU is visible to this process."""
    if not device.startswith("cuda"):
        return
    import torch

    visible = torch.cuda.is_available() if cuda_visible is None else cuda_visible
    if not visible:
        raise ValueError(f"--device {device}: no CUDA GPU is visible to this process "
                         "(torch.cuda.is_available() is False); use --device auto or cpu")
    index = int(device[5:]) if device.startswith("cuda:") else 0
    if cuda_visible is None and index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")


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
        import torch

        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "float16"
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16(flags) else "float32"


@dataclass(frozen=True)
class DeviceMemory:
    """One device's memory, measured after the worker loaded its weights (bytes)."""

    total: int  # RAM (MemTotal) or the GPU's memory
    free: int  # RAM: MemAvailable; CUDA: free on the device now (every process counted)
    weights: int  # CUDA: what torch holds for this process after the load (weights and buffers); CPU: 0
    held: int  # CUDA: what torch's allocator reserves for this process (free to us, though not free); CPU: 0


def ram(cgroup_root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int]:
    """(total, available) RAM in bytes: /proc/meminfo's MemTotal and MemAvailable (what can be allocated
    without swapping, page cache included), else the free pages where there is none; within this process's
    cgroup memory limit where it has one (a container's: /proc/meminfo shows the host's, and a fraction of
    the host's RAM gets a pod OOM-killed)."""
    path = Path("/proc/meminfo")
    total = available = 0
    if path.is_file():
        fields = {}
        for line in path.read_text().splitlines():
            name, _, value = line.partition(":")
            if value.strip().endswith("kB"):
                fields[name] = int(value.split()[0]) * 1024
        total, available = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    if not (total and available):
        page = os.sysconf("SC_PAGE_SIZE")
        total, available = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
    limit = cgroup_memory(cgroup_root)
    if limit is not None:
        limit_bytes, used_bytes = limit
        total, available = min(total, limit_bytes), min(available, max(0, limit_bytes - used_bytes))
    return total, available


def cgroup_memory(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(limit, usage) in bytes of this process's memory cgroup (v2: memory.max and memory.current; v1:
    memory/memory.limit_in_bytes and memory.usage_in_bytes); None where there is no limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:  # v1: "no limit"
            return None
        return int(limit_text), usage
    return None


def device_memory(device: str) -> DeviceMemory:
    """The device's memory now: call it after the weights are loaded (their bytes count on CUDA)."""
    if not device.startswith("cuda"):
        total, available = ram()
        return DeviceMemory(total=total, free=available, weights=0, held=0)
    import torch

    cuda = torch.device(device)
    torch.cuda.empty_cache()  # the load's freed scratch is not ours to keep
    free, total = torch.cuda.mem_get_info(cuda)
    return DeviceMemory(total=total, free=free, weights=torch.cuda.memory_allocated(cuda),
                        held=torch.cuda.memory_reserved(cuda))

