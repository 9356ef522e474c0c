"""Times KV transfers of a worker's block layout against bytes, with the serving stack's own backend.

NIXL when it imports: a sender and a receiver agent in this one process, talking over UCX as two workers on
one machine do (the same READ path; on one machine UCX moves it by CMA). Without NIXL, the local backend (a
tensor copy between two caches) stands in, and the method string says so: a cross-process backend is slower.
Each size is pulled several times between scattered block ids; the median counts.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import time

import torch

from kv_transfer import KVReceiver, KVSender, TransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.registry import BackendName, resolve
from tuner.fits import TransferPoint

logger = logging.getLogger(__name__)
# A pull that has not finished by then is a broken backend, not a slow one.
PULL_TIMEOUT_S = 60.0


def _timed_pull(sender: KVSender, receiver: KVReceiver, src: list[int], dst: list[int], block_size: int
                ) -> float:
    handle = sender.offer(src, len(src) * block_size)
    start = time.perf_counter()
    receiver.start_pull(handle, dst)
    deadline = start + PULL_TIMEOUT_S
    while time.perf_counter() < deadline:
        sender.poll()  # nixl: the sender grants the receiver's claim here
        for result in receiver.poll():
            elapsed = time.perf_counter() - start
            if result.state is not TransferState.DONE:
                raise RuntimeError(f"probe transfer failed: {result.reason}")
            sender.poll()  # releases the lease
            return elapsed
    raise RuntimeError(f"probe transfer not done within {PULL_TIMEOUT_S} s")


def measure_transfers(kv_cache: torch.Tensor, block_sizes_in_blocks: tuple[int, ...], repeats: int,
                      seed: int = 0) -> tuple[str, list[TransferPoint]]:
    """Pull `n` blocks of `kv_cache`'s layout for each n; returns (method, points).

    kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], the sender's cache.
    """
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[3]
    block_bytes = kv_cache[0].numel() * kv_cache.element_size()
    sizes = sorted({min(n, num_blocks) for n in block_sizes_in_blocks})
    receiving = torch.zeros_like(kv_cache)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")  # one machine: keep UCX off the real NICs
    config = TransferConfig(lease_s=PULL_TIMEOUT_S, transfer_timeout_s=PULL_TIMEOUT_S)
    backend = BackendName.NIXL if resolve(BackendName.NIXL).is_available() else BackendName.LOCAL
    method = ("nixl: two agents in one process over UCX (the serving path on one machine)"
              if backend is BackendName.NIXL else
              "local backend (tensor copy in one process): a memcpy stand-in, faster than a real transfer")
    sender = make_sender(backend, "tune-probe-prefill", kv_cache, config=config)
    receiver = make_receiver(backend, "tune-probe-decode", receiving, config=config)
    rng = random.Random(seed)
    points = []
    try:
        receiver.add_peer(sender.peer_info())
        for count in sizes:
            times = []
            for _ in range(repeats + 1):  # the first pull of a size warms registrations up: dropped
                src, dst = rng.sample(range(num_blocks), count), rng.sample(range(num_blocks), count)
                times.append(_timed_pull(sender, receiver, src, dst, block_size))
            points.append(TransferPoint(statistics.median(times[1:]), count * block_bytes))
    finally:
        receiver.close()
        sender.close()
    return method, points
