"""The torch backend's p2p ordering, against a fake torch.distributed that pairs isend/irecv as NCCL does.

NCCL ignores tags and pairs the n-th isend from rank A to rank B with the n-th irecv on B from A. Gloo pairs
by tag, so a real gloo group cannot show an ordering bug; the fake below can, in one process.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kv_transfer import BackendUnavailableError, ReleaseReason, TransferState, make_receiver, make_sender
from kv_transfer.backends.torch_group import check_group_backend, p2p_backend

SENDER_RANK, RECEIVER_RANK = 0, 1


class _Work:
    """A fake p2p work: finished when its peer operation is posted."""

    def __init__(self) -> None:
        self._finished = threading.Event()
        self.error = ""

    def finish(self, error: str = "") -> None:
        self.error = error
        self._finished.set()

    def wait(self) -> None:
        self._finished.wait()
        if self.error:
            raise RuntimeError(self.error)

    def is_completed(self) -> bool:
        return self._finished.is_set()


class OrderPairedP2P:
    """isend/irecv between one sender rank and one receiver rank, paired by posting order; tags ignored."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sends: collections.deque[tuple[torch.Tensor, _Work]] = collections.deque()
        self._recvs: collections.deque[tuple[torch.Tensor, _Work]] = collections.deque()
        self.rank = SENDER_RANK  # what dist.get_rank() answers while a half is being built

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> _Work:
        assert dst == RECEIVER_RANK
        return self._post(self._sends, tensor)

    def irecv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> _Work:
        assert src == SENDER_RANK
        return self._post(self._recvs, tensor)

    def _post(self, queue: collections.deque[tuple[torch.Tensor, _Work]], tensor: torch.Tensor) -> _Work:
        work = _Work()
        with self._lock:
            queue.append((tensor, work))
            while self._sends and self._recvs:
                (sent, send_work), (received, recv_work) = self._sends.popleft(), self._recvs.popleft()
                error = "" if sent.shape == received.shape else f"size mismatch {sent.shape} {received.shape}"
                if not error:
                    received.copy_(sent)
                send_work.finish(error)
                recv_work.finish(error)
        return work


def _cache(num_blocks: int, seed: int | None = None) -> torch.Tensor:
    # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    shape = (num_blocks, 2, 2, 16, 3, 8)
    if seed is None:
        return torch.zeros(shape)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def p2p(monkeypatch: pytest.MonkeyPatch) -> OrderPairedP2P:
    fake = OrderPairedP2P()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    monkeypatch.setattr(dist, "get_rank", lambda group=None: fake.rank)
    monkeypatch.setattr(dist, "isend", fake.isend)
    monkeypatch.setattr(dist, "irecv", fake.irecv)
    return fake


@pytest.fixture
def pair(p2p: OrderPairedP2P):
    sender = make_sender("torch", "prefill-0", _cache(10, seed=0))
    p2p.rank = RECEIVER_RANK
    receiver = make_receiver("torch", "decode-0", _cache(12))
    receiver.add_peer(sender.peer_info())
    return sender, receiver


def _poll_until(receiver, count: int, timeout: float = 10.0) -> dict[int, Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        results.update({r.transfer_id: r for r in receiver.poll()})
        time.sleep(0.001)
    return results


def _released(sender, count: int, timeout: float = 10.0) -> dict[int, ReleaseReason]:
    released: dict[int, ReleaseReason] = {}
    deadline = time.monotonic() + timeout
    while len(released) < count and time.monotonic() < deadline:
        released.update({r.transfer_id: r.reason for r in sender.poll()})
        time.sleep(0.001)
    return released


def test_replies_delivered_out_of_order_still_land_in_their_own_blocks(pair):
    sender, receiver = pair
    first, second = sender.offer([1, 2], num_tokens=32), sender.offer([3, 4], num_tokens=32)
    receiver.start_pull(first, [0, 1])
    receiver.start_pull(second, [2, 3])
    first_reply, second_reply = [sender.accept_pull(r) for r in receiver.take_pull_requests()]

    receiver.on_pull_reply(second_reply)  # concurrent actor calls: the later send's reply comes back first
    receiver.on_pull_reply(first_reply)
    results = _poll_until(receiver, 2)

    assert [results[h.transfer_id].state for h in (first, second)] == [TransferState.DONE] * 2
    assert torch.equal(receiver.kv_cache[[0, 1]], sender.kv_cache[[1, 2]])
    assert torch.equal(receiver.kv_cache[[2, 3]], sender.kv_cache[[3, 4]])
    assert _released(sender, 2) == {first.transfer_id: ReleaseReason.PULLED,
                                    second.transfer_id: ReleaseReason.PULLED}


def test_a_send_accepted_after_its_pull_failed_is_still_matched(pair):
    sender, receiver = pair
    late, next_one = sender.offer([5], num_tokens=16), sender.offer([6], num_tokens=16)
    receiver.start_pull(late, [7])
    (late_request,) = receiver.take_pull_requests()
    receiver._pulls[(late.source_worker_id, late.transfer_id)].deadline = 0.0  # its deadline passes
    (failed,) = receiver.poll()
    assert failed.state == TransferState.FAILED

    receiver.on_pull_reply(sender.accept_pull(late_request))  # the sender had already posted its send
    receiver.start_pull(next_one, [8])
    (next_request,) = receiver.take_pull_requests()
    receiver.on_pull_reply(sender.accept_pull(next_request))
    results = _poll_until(receiver, 1)

    assert results[next_one.transfer_id].state == TransferState.DONE
    assert torch.equal(receiver.kv_cache[8], sender.kv_cache[6])
    assert bool((receiver.kv_cache[7] == 0).all())  # the late bytes went to a discarded buffer
    assert _released(sender, 2) == {late.transfer_id: ReleaseReason.PULLED,
                                    next_one.transfer_id: ReleaseReason.PULLED}
    assert sender.num_outstanding == 0


def test_withdrawn_transfer_is_refused_and_a_claimed_one_finishes(pair):
    sender, receiver = pair
    withdrawn, claimed = sender.offer([1], num_tokens=16), sender.offer([2], num_tokens=16)
    receiver.start_pull(withdrawn, [3])
    receiver.start_pull(claimed, [4])
    withdrawn_request, claimed_request = receiver.take_pull_requests()
    claimed_reply = sender.accept_pull(claimed_request)

    released = sender.withdraw(withdrawn.transfer_id, "request aborted")
    assert released is not None and released.reason == ReleaseReason.WITHDRAWN
    assert sender.withdraw(claimed.transfer_id, "request aborted") is None  # its send is posted
    receiver.on_pull_reply(sender.accept_pull(withdrawn_request))
    receiver.on_pull_reply(claimed_reply)
    results = _poll_until(receiver, 2)

    assert results[withdrawn.transfer_id].state == TransferState.FAILED
    assert "refused" in results[withdrawn.transfer_id].reason
    assert bool((receiver.kv_cache[3] == 0).all())
    assert results[claimed.transfer_id].state == TransferState.DONE
    assert torch.equal(receiver.kv_cache[4], sender.kv_cache[2])
    assert _released(sender, 1) == {claimed.transfer_id: ReleaseReason.PULLED}
    assert sender.num_outstanding == 0


def test_nccl_for_cuda_caches_and_gloo_for_cpu_ones():
    assert p2p_backend("cuda") == p2p_backend("cuda:1") == p2p_backend(torch.device("cuda", 0)) == "nccl"
    assert p2p_backend("cpu") == "gloo"
    check_group_backend("cuda:nccl", "cuda:0")
    check_group_backend("cpu:gloo,cuda:nccl", "cpu")
    check_group_backend("cpu:gloo,cuda:nccl", "cuda")
    with pytest.raises(BackendUnavailableError, match="needs nccl for a cuda KV cache"):
        check_group_backend("cpu:gloo,cuda:gloo", "cuda")  # what init_process_group("gloo") gives
    with pytest.raises(BackendUnavailableError, match="needs gloo for a cpu KV cache"):
        check_group_backend("cuda:nccl", "cpu")


def test_a_group_with_the_wrong_backend_is_refused_at_construction(p2p, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(BackendUnavailableError, match="gloo"):
        make_sender("torch", "prefill-1", _cache(2))
