"""The in-process backend, and the receiver's lifecycle rules every backend shares."""

from __future__ import annotations

import time
from typing import ClassVar

import pytest
import torch

from kv_transfer import (
    BackendName,
    IncompatibleLayoutError,
    ReleaseReason,
    TransferConfig,
    TransferState,
    make_receiver,
    make_sender,
)
from kv_transfer.receiver import KVReceiver, Pull


def _cache(num_blocks: int, seed: int | None = None, head_dim: int = 8) -> torch.Tensor:
    # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    shape = (num_blocks, 2, 2, 16, 3, head_dim)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def pair():
    sender = make_sender("local", "prefill-0", _cache(10, seed=0))
    receiver = make_receiver("local", "decode-0", _cache(12))
    receiver.add_peer(sender.peer_info())
    yield sender, receiver
    sender.close()


def test_pull_copies_blocks_and_the_sender_releases_them(pair):
    sender, receiver = pair
    handle = sender.offer([7, 2, 3], num_tokens=40)

    assert receiver.start_pull(handle, [0, 11, 5]) == TransferState.DONE
    (result,) = receiver.poll()
    (released,) = sender.poll()

    assert (result.state, result.dst_block_ids) == (TransferState.DONE, (0, 11, 5))
    assert torch.equal(receiver.kv_cache[[0, 11, 5]], sender.kv_cache[[7, 2, 3]])
    assert (released.block_ids, released.reason) == ((7, 2, 3), ReleaseReason.PULLED)
    assert sender.num_outstanding == 0 and receiver.poll() == []
    assert [r.outcome for r in sender.recorder.records + receiver.recorder.records] == ["PULLED", "DONE"]


def test_expired_lease_is_released_and_a_late_pull_fails_without_writing(pair):
    sender, receiver = pair
    handle = sender.offer([1, 2], num_tokens=20, lease_s=1e-6)
    time.sleep(0.01)

    (released,) = sender.poll()
    state = receiver.start_pull(handle, [3, 4])
    (result,) = receiver.poll()

    assert released.reason == ReleaseReason.EXPIRED and sender.num_outstanding == 0
    assert state == TransferState.FAILED and "lease" in result.reason
    assert bool((receiver.kv_cache[[3, 4]] == 0).all())


def test_sender_refuses_a_pull_after_expiry_even_if_the_receiver_is_early():
    sender = make_sender("local", "prefill-1", _cache(4, seed=1))
    # A receiver with no margin and a sender whose lease already ended: only the sender can refuse.
    receiver = make_receiver("local", "decode-1", _cache(4), config=TransferConfig(lease_margin_s=0.0))
    receiver.add_peer(sender.peer_info())
    handle = sender.offer([0], num_tokens=1, lease_s=30.0)
    sender._leases.get(handle.transfer_id).deadline = 0.0  # the sender's clock says the lease is over

    assert receiver.start_pull(handle, [2]) == TransferState.FAILED
    assert "expired" in receiver.poll()[0].reason
    assert bool((receiver.kv_cache[2] == 0).all())
    sender.close()


def test_a_withdrawn_transfer_is_freed_at_once_and_a_later_pull_fails_without_writing(pair):
    sender, receiver = pair
    handle = sender.offer([4, 5], num_tokens=20)

    released = sender.withdraw(handle.transfer_id, "request aborted")
    state = receiver.start_pull(handle, [6, 7])
    (result,) = receiver.poll()

    assert released is not None
    assert (released.block_ids, released.reason) == ((4, 5), ReleaseReason.WITHDRAWN)
    assert state == TransferState.FAILED and "released" in result.reason
    assert bool((receiver.kv_cache[[6, 7]] == 0).all())
    assert sender.poll() == [] and sender.num_outstanding == 0  # reported once, by withdraw()
    assert sender.withdraw(handle.transfer_id, "again") is None
    assert [r.outcome for r in sender.recorder.records] == ["WITHDRAWN"]


def test_withdraw_leaves_a_pulled_transfer_to_be_reported_pulled(pair):
    sender, receiver = pair
    handle = sender.offer([8], num_tokens=16)
    assert receiver.start_pull(handle, [9]) == TransferState.DONE

    assert sender.withdraw(handle.transfer_id, "too late") is None
    (released,) = sender.poll()

    assert released.reason == ReleaseReason.PULLED and sender.num_outstanding == 0
    assert torch.equal(receiver.kv_cache[9], sender.kv_cache[8])


def test_incompatible_layouts_and_bad_block_lists_are_refused(pair):
    sender, receiver = pair
    other = make_receiver("local", "decode-x", _cache(4, head_dim=4))
    with pytest.raises(IncompatibleLayoutError, match="head_dim"):
        other.add_peer(sender.peer_info())
    handle = sender.offer([1, 2], num_tokens=20)
    with pytest.raises(ValueError, match="2 source blocks but 1 destination"):
        receiver.start_pull(handle, [0])
    with pytest.raises(ValueError, match="out of range"):
        receiver.start_pull(handle, [0, 12])
    with pytest.raises(ValueError, match="out of range"):
        sender.offer([10], num_tokens=1)
    with pytest.raises(KeyError, match="add_peer"):
        other.start_pull(handle, [0, 1])


class _StuckReceiver(KVReceiver):
    """A backend whose bytes never arrive."""

    backend: ClassVar[BackendName] = BackendName.LOCAL
    aborted: list[int]

    def _start(self, pull: Pull, peer) -> None:
        pull.state = TransferState.TRANSFERRING
        self.aborted = []

    def _advance(self, pull: Pull) -> None:
        return None

    def _abort(self, pull: Pull) -> bool:
        self.aborted.append(pull.handle.transfer_id)
        return True


def test_a_pull_that_never_finishes_fails_at_its_deadline(pair):
    sender, _ = pair
    receiver = _StuckReceiver("decode-2", _cache(4), config=TransferConfig(transfer_timeout_s=1e-6))
    receiver.add_peer(sender.peer_info())
    handle = sender.offer([1], num_tokens=16)

    assert receiver.start_pull(handle, [0]) == TransferState.TRANSFERRING
    time.sleep(0.01)
    (result,) = receiver.poll()

    assert result.state == TransferState.FAILED and "deadline" in result.reason
    assert receiver.aborted == [handle.transfer_id]


def test_a_peer_added_again_with_a_new_endpoint_replaces_the_stale_one(pair):
    """L8: a worker that changed role and came back offers from a new endpoint (here a larger KV cache under
    the same worker id); add_peer learns it in place of the stale one, so its handles are pulled, not
    refused against the old layout."""
    _, receiver = pair
    new = make_sender("local", "prefill-0", _cache(20, seed=2))
    try:
        receiver.add_peer(new.peer_info())
        handle = new.offer([15, 19], num_tokens=20)
        assert receiver.start_pull(handle, [0, 1]) == TransferState.DONE
        assert torch.equal(receiver.kv_cache[[0, 1]], new.kv_cache[[15, 19]])
    finally:
        new.close()


@pytest.mark.parametrize(("source", "destination"), [(torch.bfloat16, torch.float8_e4m3fn),
                                                     (torch.float8_e4m3fn, torch.bfloat16),
                                                     (torch.float32, torch.float8_e5m2)])
def test_a_pull_into_another_element_type_converts_as_a_forward_would_store(source, destination):
    """A bfloat16 prefill worker's blocks into an fp8 decode worker's cache and back: the receiver holds the
    values its own forward would have written (llm_engine/kv_dtype.py store, saturating at 8-bit's range)."""
    from llm_engine.kv_dtype import store

    held = _cache(6, seed=3) * 300  # past e4m3's ±448 in places: saturated, never an inf or a NaN
    sender = make_sender("local", "prefill-c", held.to(source))
    receiver = make_receiver("local", "decode-c", _cache(8).to(destination))
    receiver.add_peer(sender.peer_info())
    handle = sender.offer([4, 1, 2], num_tokens=40)

    assert receiver.start_pull(handle, [0, 6, 7]) == TransferState.DONE
    (result,) = receiver.poll()
    expected = torch.zeros((3, *held.shape[1:]), dtype=destination)
    flat = expected.view(3, -1)
    store(flat, torch.arange(3), sender.kv_cache[[4, 1, 2]].reshape(3, -1))  # as a forward writes its own
    assert torch.equal(receiver.kv_cache[[0, 6, 7]].float(), expected.float())
    assert torch.isfinite(receiver.kv_cache.float()).all()
    assert result.state == TransferState.DONE
    assert receiver.recorder.records[-1].num_bytes == 3 * sender.layout.block_bytes  # the wire's bytes
    sender.close()


def test_a_sender_with_a_wire_dtype_offers_its_blocks_in_it():
    """--kv-transfer-dtype fp8 between two bfloat16 caches: the blocks cross in fp8 (half the bytes) and land
    as bfloat16 again, each value rounded once through fp8."""
    from kv_transfer.conversion import converted

    held = _cache(6, seed=5).to(torch.bfloat16)
    sender = make_sender("local", "prefill-w", held, config=TransferConfig(wire_dtype="float8_e4m3fn"))
    receiver = make_receiver("local", "decode-w", _cache(8).to(torch.bfloat16))
    assert (sender.layout.dtype, sender.peer_info().layout.block_bytes) == ("float8_e4m3fn",
                                                                           held[0].numel())
    receiver.add_peer(sender.peer_info())
    handle = sender.offer([5, 0], num_tokens=20)

    assert receiver.start_pull(handle, [3, 1]) == TransferState.DONE
    receiver.poll()
    (released,) = sender.poll()
    assert released.block_ids == (5, 0)  # the cache's blocks: the owner frees them as any others
    through_fp8 = converted(held[[5, 0]], torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(receiver.kv_cache[[3, 1]], through_fp8)
    assert receiver.recorder.records[-1].num_bytes == 2 * held[0].numel()  # one byte an element
    with pytest.raises(ValueError, match="wire_dtype must be one of"):
        TransferConfig(wire_dtype="int8")
    sender.close()
