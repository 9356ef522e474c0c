"""Backend registry: names (BackendName) -> capabilities (kv_transfer/capabilities.py) and lazily imported
sender/receiver classes; an unknown name is an error that lists the known ones."""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_transfer.capabilities import CAPABILITIES, BackendCapabilities
from kv_transfer.enums import BackendName

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender

logger = logging.getLogger(__name__)


class UnknownBackendError(ValueError):
    """A backend name that the registry does not know."""


class BackendUnavailableError(RuntimeError):
    """A backend that is known but cannot run here (not installed, no process group, not colocated)."""


@dataclass(frozen=True)
class BackendSpec:
    """One registry entry; the module is imported only when the backend is used."""

    name: BackendName  # registry key
    module: str  # module holding the two classes
    sender_class: str  # KVSender subclass name in `module`
    receiver_class: str  # KVReceiver subclass name in `module`
    capabilities: BackendCapabilities  # see kv_transfer/capabilities.py
    is_available: Callable[[], bool]  # cheap check that the backend can run in this process


# nixl's wheels for each accelerator stack, in the order nixl takes the first installed when it finds no CUDA.
NIXL_VARIANTS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _nixl_bindings_module() -> str:
    """The module whose import says whether nixl runs here. nixl's own `nixl._bindings`, except where torch
    is a CPU build not imported yet (a fleet actor, which holds no torch): nixl imports torch (1.4 s) to ask
    its CUDA version and, finding none, takes the first variant installed, as this does without torch."""
    if "torch" in sys.modules or not importlib.metadata.version("torch").endswith("+cpu"):
        return "nixl._bindings"
    return next((f"{v}._bindings" for v in NIXL_VARIANTS if importlib.util.find_spec(v)), "nixl._bindings")


@functools.cache
def _nixl_is_available() -> bool:
    if importlib.util.find_spec("nixl") is None:
        return False
    try:
        importlib.import_module(_nixl_bindings_module())
    except ImportError as exc:  # e.g. the meta package without a CUDA-variant wheel
        logger.info("nixl is installed but does not import: %s", exc)
        return False
    return True


def _torch_dist_is_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


BACKENDS: dict[BackendName, BackendSpec] = {
    BackendName.LOCAL: BackendSpec(
        BackendName.LOCAL, "kv_transfer.backends.local", "LocalSender", "LocalReceiver",
        CAPABILITIES[BackendName.LOCAL], lambda: True,
    ),
    BackendName.NIXL: BackendSpec(
        BackendName.NIXL, "kv_transfer.backends.nixl", "NixlSender", "NixlReceiver",
        CAPABILITIES[BackendName.NIXL], _nixl_is_available,
    ),
    BackendName.TORCH: BackendSpec(
        BackendName.TORCH, "kv_transfer.backends.torch_dist", "TorchSender", "TorchReceiver",
        CAPABILITIES[BackendName.TORCH], _torch_dist_is_available,
    ),
}


def resolve(name: str | BackendName) -> BackendSpec:
    """Look a backend up by name.

    Args:
        name: a BackendName or its string value ("nixl", "torch", "local").

    Returns:
        Its registry entry.

    Raises:
        UnknownBackendError: listing the known names.
    """
    try:
        return BACKENDS[BackendName(name)]
    except ValueError:
        known = ", ".join(b.value for b in BACKENDS)
        raise UnknownBackendError(f"unknown KV transfer backend {name!r}; known: {known}") from None


def capabilities(name: str | BackendName) -> BackendCapabilities:
    """The declared capabilities of a backend (no import of the backend itself)."""
    return resolve(name).capabilities


def can_move_kv_between_decode_workers(name: str | BackendName) -> bool:
    """Whether a decode worker that hands a running stream back can offer its KV to another decode worker
    (KV migration): the backend must cross processes and accept peers added at any time."""
    caps = capabilities(name)
    return caps.crosses_processes and not caps.needs_peer_bound_up_front and not caps.sender_takes_part


def _load(name: str | BackendName, attr: str) -> Any:
    spec = resolve(name)
    if not spec.is_available():
        raise BackendUnavailableError(f"KV transfer backend {spec.name} is not available here")
    return getattr(importlib.import_module(spec.module), getattr(spec, attr))


def make_sender(name: str | BackendName, worker_id: str, kv_cache: Any, **kwargs: Any) -> KVSender:
    """Build a backend's sender half (prefill side).

    Args:
        name: backend name.
        worker_id: unique id of this worker.
        kv_cache: the engine's KV tensor, [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim].
        **kwargs: config=, recorder=, and backend-specific options (torch: group=).

    Returns:
        The sender.
    """
    return _load(name, "sender_class")(worker_id, kv_cache, **kwargs)


def make_receiver(name: str | BackendName, worker_id: str, kv_cache: Any, **kwargs: Any) -> KVReceiver:
    """Build a backend's receiver half (decode side); arguments as for make_sender."""
    return _load(name, "receiver_class")(worker_id, kv_cache, **kwargs)
