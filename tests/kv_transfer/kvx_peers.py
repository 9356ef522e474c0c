"""Child-process side of the two-process KV transfer tests: one sender or receiver per process.

The test process plays the caller (later: a Ray actor call): it carries every message between the two
children as msgpack bytes, so the wire format is exercised too. Each child runs `serve()`, answering
(command, args) tuples on a pipe until "stop".
"""

from __future__ import annotations

import hashlib
import os
import time
from typing import Any

# Defaults used by both children and the tests: the default model's layout with few blocks.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16


def make_cache(num_blocks: int, dtype_name: str, head_dim: int, fill_seed: int | None) -> Any:
    import torch

    dtype = getattr(torch, dtype_name)
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    if fill_seed is None:
        return torch.zeros(shape, dtype=dtype)
    generator = torch.Generator().manual_seed(fill_seed)
    return torch.randn(shape, generator=generator).to(dtype)


def checksum(kv_cache: Any, block_ids: list[int]) -> str:
    """sha256 of the blocks' bytes, in the order given."""
    import torch

    digest = hashlib.sha256()
    for block_id in block_ids:
        digest.update(kv_cache[block_id].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def serve(conn: Any, role: str, backend: str, options: dict[str, Any]) -> None:
    """Child main: build a sender ("prefill") or receiver ("decode") and answer commands."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torch

    torch.set_num_threads(1)
    from kv_transfer import KVHandle, PeerInfo, PullReply, PullRequest, TransferConfig, wire
    from kv_transfer.conversion import converted
    from kv_transfer.registry import make_receiver, make_sender

    if backend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=options["init_method"], rank=options["rank"],
                                world_size=2)
    kv_cache = make_cache(options["num_blocks"], options.get("dtype", "float32"),
                          options.get("head_dim", HEAD_DIM), options.get("fill_seed"))
    config = TransferConfig(**options.get("config", {}))
    make = make_sender if role == "prefill" else make_receiver
    half: Any = make(backend, f"{role}-{os.getpid()}", kv_cache, config=config)

    def idle_cpu(seconds: float) -> float:
        cpu0, wall0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - cpu0) / (time.monotonic() - wall0)

    def converted_checksum(ids: list[int], dtype: str, wire: str = "") -> str:
        """The blocks as a cache of another element type holds them (a converting pull's expected bytes),
        through the wire's type on the way where one is given."""
        blocks = kv_cache[ids]
        if wire:
            blocks = converted(blocks, getattr(torch, wire))
        return checksum(converted(blocks, getattr(torch, dtype)), list(range(len(ids))))

    commands = {
        "peer_info": lambda: wire.encode(half.peer_info()),
        "offer": lambda ids, n, lease_s: wire.encode(half.offer(ids, n, lease_s)),
        "accept": lambda req: wire.encode(half.accept_pull(wire.decode(PullRequest, req))),
        "sender_poll": lambda: [(r.transfer_id, list(r.block_ids), r.reason.name) for r in half.poll()],
        "withdraw": lambda transfer_id, why: [(r.transfer_id, list(r.block_ids), r.reason.name)
                                              for r in [half.withdraw(transfer_id, why)] if r is not None],
        "add_peer": lambda info: half.add_peer(wire.decode(PeerInfo, info)),
        "start_pull": lambda handle, dst: half.start_pull(wire.decode(KVHandle, handle), dst).name,
        "take_requests": lambda: [wire.encode(r) for r in half.take_pull_requests()],
        "on_reply": lambda reply: half.on_pull_reply(wire.decode(PullReply, reply)),
        "receiver_poll": lambda: [(r.transfer_id, r.state.name, r.reason) for r in half.poll()],
        "checksum": lambda ids: checksum(kv_cache, ids),
        "converted_checksum": converted_checksum,
        "is_zero": lambda ids: bool((kv_cache[ids] == 0).all()),
        "idle_cpu": idle_cpu,
        "records": lambda: [(r.transfer_id, r.outcome, r.num_bytes) for r in half.recorder.records],
        "num_outstanding": lambda: half.num_outstanding,
    }
    conn.send(("ready", None))
    while True:
        command, args = conn.recv()
        if command == "stop":
            half.close()
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", commands[command](*args)))
        except Exception as exc:
            conn.send(("error", (type(exc).__name__, str(exc))))
