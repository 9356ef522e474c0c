"""Locks that the processes of one node take in turn: kernel `flock`s on files in the node's temp directory or
beside a build, released by the kernel when their holder dies (a worker killed mid-start leaves nothing
held, unlike a lock file whose existence is the lock).

    node_memory_lock(device)   from measuring the free memory until the KV cache is allocated (review N12)
    build_lock(build_dir)      around a JIT build of a native kernel (llm_engine/native_kernels.py)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

# Every worker process on a node shares it.
MEMORY_LOCK_DIR = Path(os.environ.get("TMPDIR", "/tmp"))


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing), held for the block; waits for its holder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def node_memory_lock(device: str) -> contextlib.AbstractContextManager[None]:
    """Held from measuring the free memory until this worker's KV cache is allocated (and its pages written):
    with a budget that is a fraction of what is free, two workers starting at once on one node would each
    measure the same free memory and together take more than there is (review N12). The second waits (an
    allocation takes a second or two) and measures what the first has left."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return file_lock(MEMORY_LOCK_DIR / f"pdserve-kv-sizing-{kind}.lock")


def build_lock(build_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Held around a native kernel's build in `build_dir`: one process builds, the others wait and load."""
    return file_lock(build_dir / "pdserve-build.flock")
