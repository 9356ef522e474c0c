"""The NIXL backend in one process (two real agents over UCX): claims, the sender's clock, handle releases."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any

import pytest
import torch

from kv_transfer import ReleaseReason, TransferConfig, TransferState, make_receiver, make_sender

pytest.importorskip("nixl._bindings")

_names = itertools.count()


class CountingBinding:
    """Wraps an agent's NIXL binding: records every transfer handle made and released; can refuse releases."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding
        self.made: list[int] = []
        self.released: list[int] = []
        self.num_releases_to_refuse = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def makeXferReq(self, *args: Any) -> int:
        xfer = self._binding.makeXferReq(*args)
        self.made.append(int(xfer))
        return xfer

    def releaseXferReq(self, xfer: int) -> Any:
        if self.num_releases_to_refuse:
            self.num_releases_to_refuse -= 1
            raise RuntimeError("NIXL_ERR_REPOST_ACTIVE")  # what the binding raises when it cannot cancel
        assert xfer in self.made and xfer not in self.released, "a handle released twice or never made"
        self.released.append(xfer)
        return self._binding.releaseXferReq(xfer)


def _cache(num_blocks: int, seed: int | None = None) -> torch.Tensor:
    # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    shape = (num_blocks, 2, 2, 16, 3, 8)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _pair(receiver_config: TransferConfig | None = None):
    n = next(_names)
    sender = make_sender("nixl", f"prefill-nixl-{n}", _cache(8, seed=n))
    receiver = make_receiver("nixl", f"decode-nixl-{n}", _cache(8), config=receiver_config)
    receiver.add_peer(sender.peer_info())
    binding = CountingBinding(receiver.agent._agent)
    receiver.agent._agent = binding
    return sender, receiver, binding


@pytest.fixture
def pair():
    sender, receiver, binding = _pair()
    yield sender, receiver, binding
    receiver.close()
    sender.close()


def _drive(sender, receiver, released: dict[int, ReleaseReason], until, timeout: float = 10.0) -> dict:
    """Poll both halves (the sender answers claims in its poll) until `until(results, released)`."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while not until(results, released) and time.monotonic() < deadline:
        results.update({r.transfer_id: r for r in receiver.poll()})
        for r in sender.poll():
            assert r.transfer_id not in released, "released twice"
            released[r.transfer_id] = r.reason
        time.sleep(0.001)
    return results


def _wait_claimed(sender, transfer_id: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not sender._leases.get(transfer_id).is_claimed and time.monotonic() < deadline:
        sender.poll()
        time.sleep(0.001)
    assert sender._leases.get(transfer_id).is_claimed


def test_pull_is_claimed_granted_read_and_its_handle_released_once(pair):
    sender, receiver, binding = pair
    handle = sender.offer([6, 1, 2], num_tokens=40)
    released: dict[int, ReleaseReason] = {}

    assert receiver.start_pull(handle, [0, 4, 5]) == TransferState.PENDING  # until the sender grants
    results = _drive(sender, receiver, released, lambda res, rel: res and rel)

    assert results[handle.transfer_id].state == TransferState.DONE
    assert torch.equal(receiver.kv_cache[[0, 4, 5]], sender.kv_cache[[6, 1, 2]])
    assert released == {handle.transfer_id: ReleaseReason.PULLED}
    assert len(binding.made) == 1 and sorted(binding.released) == sorted(binding.made)
    assert sender.num_outstanding == 0


@pytest.mark.parametrize("is_expiry_seen_first", [True, False], ids=["released-first", "claimed-first"])
def test_a_lease_over_by_the_senders_clock_is_refused_whatever_the_receivers_clock_says(
        pair, is_expiry_seen_first: bool):
    sender, receiver, binding = pair
    handle = sender.offer([3], num_tokens=16, lease_s=0.05)
    time.sleep(0.1)
    released: dict[int, ReleaseReason] = {}
    if is_expiry_seen_first:
        (expired,) = sender.poll()
        assert (expired.transfer_id, expired.reason) == (handle.transfer_id, ReleaseReason.EXPIRED)
        released[handle.transfer_id] = expired.reason
    # Clock skew: by the receiver's clock the lease has an hour left.
    skewed = dataclasses.replace(handle, lease_deadline=time.time() + 3600)

    assert receiver.start_pull(skewed, [6]) == TransferState.PENDING
    results = _drive(sender, receiver, released, lambda res, rel: res and rel)

    assert results[handle.transfer_id].state == TransferState.FAILED
    assert "refused" in results[handle.transfer_id].reason
    assert binding.made == []  # no READ ever touched the (freed) source block
    assert bool((receiver.kv_cache[6] == 0).all())
    assert released == {handle.transfer_id: ReleaseReason.EXPIRED}


def test_withdrawn_transfer_is_refused_and_a_granted_one_finishes(pair):
    sender, receiver, binding = pair
    withdrawn, granted = sender.offer([1], num_tokens=16), sender.offer([2], num_tokens=16)
    receiver.start_pull(granted, [3])
    _wait_claimed(sender, granted.transfer_id)

    released = sender.withdraw(withdrawn.transfer_id, "request aborted")
    assert released is not None and released.reason == ReleaseReason.WITHDRAWN
    assert sender.withdraw(granted.transfer_id, "request aborted") is None  # granted: left to finish
    receiver.start_pull(withdrawn, [4])
    reasons: dict[int, ReleaseReason] = {}
    results = _drive(sender, receiver, reasons, lambda res, rel: len(res) == 2 and rel)

    assert results[withdrawn.transfer_id].state == TransferState.FAILED
    assert "refused" in results[withdrawn.transfer_id].reason
    assert bool((receiver.kv_cache[4] == 0).all())
    assert results[granted.transfer_id].state == TransferState.DONE
    assert torch.equal(receiver.kv_cache[3], sender.kv_cache[2])
    assert reasons == {granted.transfer_id: ReleaseReason.PULLED}
    assert len(binding.made) == 1 and binding.released == binding.made
    assert sender.num_outstanding == 0


def test_a_grant_whose_read_never_comes_is_freed_when_its_hold_ends():
    sender, receiver, binding = _pair(TransferConfig(transfer_timeout_s=0.3))
    try:
        handle = sender.offer([5], num_tokens=16)
        receiver.start_pull(handle, [2])
        _wait_claimed(sender, handle.transfer_id)  # granted; the receiver does not poll (stalled)
        time.sleep(0.4)

        (released,) = sender.poll()
        results = _drive(sender, receiver, {}, lambda res, rel: res)

        assert (released.transfer_id, released.reason) == (handle.transfer_id, ReleaseReason.FAILED)
        assert results[handle.transfer_id].state == TransferState.FAILED
        assert binding.made == []  # the late grant was dropped, never read on
        assert bool((receiver.kv_cache[2] == 0).all())
    finally:
        receiver.close()
        sender.close()


def test_a_refused_release_is_retried_and_never_reaches_the_step_loop(pair):
    sender, receiver, binding = pair
    binding.num_releases_to_refuse = 2
    handle = sender.offer([4, 5], num_tokens=32)
    released: dict[int, ReleaseReason] = {}

    receiver.start_pull(handle, [1, 2])
    results = _drive(sender, receiver, released, lambda res, rel: res and rel and binding.released)

    assert results[handle.transfer_id].state == TransferState.DONE  # the READ itself had finished
    assert torch.equal(receiver.kv_cache[[1, 2]], sender.kv_cache[[4, 5]])
    assert binding.released == binding.made and len(binding.made) == 1


def _stuck_read(receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every READ look in flight for ever (the real one finishes; its status is hidden)."""
    real_read = receiver.agent.read
    monkeypatch.setattr(receiver.agent, "read", lambda *args: (real_read(*args)[0], "PROC"))
    monkeypatch.setattr(receiver.agent, "status", lambda xfer: "PROC")


def test_a_read_nixl_cannot_cancel_at_the_deadline_is_reported_only_once_cancelled(
        pair, monkeypatch: pytest.MonkeyPatch):
    sender, receiver, binding = pair
    _stuck_read(receiver, monkeypatch)
    handle = sender.offer([7], num_tokens=16)
    receiver.start_pull(handle, [5])
    key = (handle.source_worker_id, handle.transfer_id)
    released: dict[int, ReleaseReason] = {}
    _drive(sender, receiver, released, lambda res, rel: receiver.state(*key) == TransferState.TRANSFERRING)

    receiver._pulls[key].deadline = 0.0  # the deadline passes
    binding.num_releases_to_refuse = 1
    assert receiver.poll() == []  # could not cancel: not reported, since bytes might still land
    (result,) = receiver.poll()

    assert result.state == TransferState.FAILED and "deadline" in result.reason
    assert binding.released == binding.made and len(binding.made) == 1
    _drive(sender, receiver, released, lambda res, rel: rel)
    assert list(released) == [handle.transfer_id] and sender.num_outstanding == 0


def test_close_releases_the_handles_of_reads_in_flight(monkeypatch: pytest.MonkeyPatch):
    sender, receiver, binding = _pair()
    _stuck_read(receiver, monkeypatch)
    handles = [sender.offer([b], num_tokens=16) for b in (1, 2)]
    for dst, handle in zip((3, 4), handles, strict=True):
        receiver.start_pull(handle, [dst])
    _drive(sender, receiver, {}, lambda res, rel: len(binding.made) == 2)

    receiver.close()
    sender.close()

    assert sorted(binding.released) == sorted(binding.made) and len(binding.made) == 2


def test_a_foreign_notification_is_ignored(pair):
    sender, receiver, _binding = pair
    receiver.agent.send_notif(sender.agent.name, b"kvx:12345")  # the old completion format, say
    handle = sender.offer([0], num_tokens=16)
    receiver.start_pull(handle, [7])
    results = _drive(sender, receiver, {}, lambda res, rel: res)

    assert results[handle.transfer_id].state == TransferState.DONE


def test_a_pull_cancelled_after_its_claim_frees_both_sides_at_once(pair):
    sender, receiver, binding = pair
    handle = sender.offer([3], num_tokens=16)
    receiver.start_pull(handle, [6])
    _wait_claimed(sender, handle.transfer_id)  # granted; the grant has not been read yet

    assert receiver.cancel(handle.source_worker_id, handle.transfer_id, "the request was aborted")
    (result,) = receiver.poll()  # reported at once, not at the deadline (10 s)
    released: dict[int, ReleaseReason] = {}
    _drive(sender, receiver, released, lambda res, rel: rel, timeout=1.0)  # the DROP ends the grant

    assert result.state == TransferState.FAILED and "aborted" in result.reason
    assert released == {handle.transfer_id: ReleaseReason.FAILED}
    assert binding.made == []  # no READ was posted
    assert sender.num_outstanding == 0


def test_a_claim_for_withdrawn_kv_is_still_expected_and_refused(pair):
    sender, receiver, _binding = pair
    handle = sender.offer([2], num_tokens=16)
    assert sender.expects_claims
    sender.withdraw(handle.transfer_id, "the client left")

    # Nothing is offered, but the receiver had the handle: the owner must keep polling to refuse it.
    assert sender.num_outstanding == 0 and sender.expects_claims
    receiver.start_pull(handle, [1])
    results = _drive(sender, receiver, {}, lambda res, rel: res, timeout=1.0)
    assert results[handle.transfer_id].state == TransferState.FAILED
    assert "refused" in results[handle.transfer_id].reason


def test_a_lease_withdrawn_is_expected_to_be_claimed_only_until_its_deadline(pair):
    sender, _receiver, _binding = pair
    handle = sender.offer([2], num_tokens=16, lease_s=0.05)
    sender.withdraw(handle.transfer_id, "the client left")
    time.sleep(0.1)
    assert not sender.expects_claims


def test_a_sender_forgets_an_idle_receiver_and_loads_it_again_at_its_next_claim():
    """Review P10: a sender kept every receiver agent it ever answered (one per role change or replacement
    of each decode worker). One idle for idle_receiver_s with no grant is forgotten; its next claim carries
    its connection info again, and the pull works."""
    n = next(_names)
    sender = make_sender("nixl", f"prefill-nixl-{n}", _cache(8, seed=n),
                         config=TransferConfig(idle_receiver_s=0.2))
    receiver = make_receiver("nixl", f"decode-nixl-{n}", _cache(8))
    receiver.add_peer(sender.peer_info())
    try:
        for dst in ([0, 1], [2, 3]):
            handle = sender.offer([4, 5], num_tokens=20)
            receiver.start_pull(handle, dst)
            released: dict[int, ReleaseReason] = {}
            results = _drive(sender, receiver, released, lambda res, rel: res and rel)
            assert results[handle.transfer_id].state == TransferState.DONE
            assert torch.equal(receiver.kv_cache[dst], sender.kv_cache[[4, 5]])
            assert sender.num_known_receivers == 1
            deadline = time.monotonic() + 5
            while sender.num_known_receivers and time.monotonic() < deadline:
                sender.poll()
                time.sleep(0.05)
            assert sender.num_known_receivers == 0  # forgotten while idle
    finally:
        receiver.close()
        sender.close()


def test_a_peer_whose_wiring_fails_part_way_leaves_nothing_loaded_and_can_be_added_again():
    """Review LOW: add_peer failing after the peer's agent was loaded (its blocks could not be prepared) left
    the agent loaded and its name mapped; now all or nothing."""
    n = next(_names)
    sender = make_sender("nixl", f"prefill-nixl-{n}", _cache(8, seed=n))
    receiver = make_receiver("nixl", f"decode-nixl-{n}", _cache(8))
    forgotten: list[str] = []
    forget, prep = receiver.agent.forget_remote, receiver.agent.prep_blocks

    def broken_prep(*args: Any) -> int:
        raise RuntimeError("injected fault: NIXL could not prepare the peer's blocks")

    receiver.agent.forget_remote = lambda name, dlist: (forgotten.append(name), forget(name, dlist))[1]
    receiver.agent.prep_blocks = broken_prep
    try:
        with pytest.raises(RuntimeError, match="injected fault"):
            receiver.add_peer(sender.peer_info())
        assert forgotten and not receiver._agent_names and sender.worker_id not in receiver.peers
        receiver.agent.prep_blocks = prep
        receiver.add_peer(sender.peer_info())  # wired whole now: a pull works
        handle = sender.offer([3], num_tokens=10)
        receiver.start_pull(handle, [6])
        results = _drive(sender, receiver, {}, lambda res, rel: res and rel)
        assert results[handle.transfer_id].state == TransferState.DONE
        assert torch.equal(receiver.kv_cache[[6]], sender.kv_cache[[3]])
    finally:
        receiver.close()
        sender.close()
