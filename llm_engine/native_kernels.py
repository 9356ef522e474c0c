"""pdserve's own C++ kernels (llm_engine/csrc/), built for this machine's CPU on first use and cached.

    paged_decode_attention() → the kernel, or None where it cannot be built (no compiler, no headers): the
    engine then keeps the gather + SDPA path, and says which one it runs in the worker's info.
The build (about 6 s, once per machine and torch version) goes to torch's extension cache
(~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR); processes that start together wait on a flock
(llm_engine/node_locks.py), which a builder killed mid-build does not leave held. The
build uses every instruction this CPU has (-march=native), so its name carries a digest of the CPU's flags:
a home directory shared by nodes of different CPUs never hands one a binary built for another.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from llm_engine.hardware import cpu_flags
from llm_engine.node_locks import build_lock

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
# -march=native: the cache is per machine, so the build may use every instruction this CPU has (AVX-512).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]

# What the kernel is built for (csrc/paged_decode_attention.cpp): head dims, query heads per KV head, block.
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 256)
KERNEL_MAX_GROUPS = 16
KERNEL_MAX_BLOCK_SIZE = 256

DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float],
                        torch.Tensor]


def _cpu_digest() -> str:
    """8 hex digits naming this CPU's instruction set (its /proc/cpuinfo flags)."""
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def kernel_unfit_reason(head_dim: int, num_heads: int, num_kv_heads: int, block_size: int) -> str | None:
    """Why the kernel cannot serve this model's shape, or None when it can."""
    if head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim {head_dim} (built for {', '.join(map(str, KERNEL_HEAD_DIMS))})"
    if num_heads // num_kv_heads > KERNEL_MAX_GROUPS:
        return f"{num_heads // num_kv_heads} query heads per KV head (at most {KERNEL_MAX_GROUPS})"
    if block_size > KERNEL_MAX_BLOCK_SIZE:
        return f"block size {block_size} (at most {KERNEL_MAX_BLOCK_SIZE})"
    return None


@functools.cache
def paged_decode_attention() -> DecodeKernel | None:
    """The C++ paged decode attention (see its source for the contract), or None if it does not build."""
    # torch runs `ninja` from PATH; the one pip installed sits beside this interpreter, which a worker
    # started as `.venv/bin/python` (venv not activated) does not have on its PATH.
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin) is not None:
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"pdserve_paged_attention_{_cpu_digest()}"
        build_dir = Path(_get_build_directory(name, verbose=False))
        with build_lock(build_dir):
            # torch's own lock is a file whose existence is the lock: a builder killed mid-build (a worker
            # replaced while it started) leaves it, and every later process waits on it for ever. Under our
            # flock nobody else is building, so such a file is stale.
            (build_dir / "lock").unlink(missing_ok=True)
            # A library that registers the op (torch.ops.pdserve_native), not a Python module.
            load(name, [str(SOURCES / "paged_decode_attention.cpp")], extra_cflags=CFLAGS,
                 extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as error:  # a missing compiler or header is a slower engine, not a dead one
        logger.warning("pdserve's paged decode attention kernel did not build (%s: %s); decode attention "
                       "gathers each sequence's KV and runs SDPA instead", type(error).__name__, error)
        return None
    kernel: DecodeKernel = torch.ops.pdserve_native.paged_decode_attention
    return kernel
