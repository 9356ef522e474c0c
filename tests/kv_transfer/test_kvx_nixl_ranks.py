"""NIXL between workers of different tensor-parallel degrees, in one process: each "rank" is a real agent over
its own cache (a RankTransfers, reached by a direct call where a worker's step mirror would carry the op), and
every destination rank's heads arrive, read from the source ranks that hold them; the sender is told PULLED
only when every rank's READs are done."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv_transfer import ReleaseReason, TransferConfig, TransferState, make_receiver, make_sender
from kv_transfer.backends.nixl_agent import NixlAgent
from kv_transfer.backends.nixl_ranks import PostReads, RankTransfers
from kv_transfer.enums import BackendName

pytest.importorskip("nixl._bindings")

SHARES = {1: [(0, 3)], 2: [(0, 2), (2, 1)]}  # (first KV head, KV heads) per rank: 3 heads over 1 or 2 ranks
_names = itertools.count()


class Worker:
    """One worker's ranks: rank 0's cache goes to its sender or receiver; the others answer its ops."""

    def __init__(self, tp: int, name: str, seed: int | None) -> None:
        generator = torch.Generator().manual_seed(seed or 0)
        self.caches = [torch.zeros(8, 2, 2, 4, n, 8) for _, n in SHARES[tp]]
        if seed is not None:
            for cache in self.caches:
                cache.copy_(torch.randn(cache.shape, generator=generator))
        self.others = [RankTransfers(name, rank, first, self.caches[rank])
                       for rank, (first, _) in enumerate(SHARES[tp]) if rank > 0]
        self.name = name

    def call_ranks(self, op: object, meanwhile: Any = None) -> list[Any]:
        answers = [rank.handle(op) for rank in self.others]
        if meanwhile is not None:
            meanwhile()
        return answers

    def kwargs(self) -> dict[str, Any]:
        return {"ranks": self.call_ranks} if self.others else {}

    def whole(self) -> torch.Tensor:
        return torch.cat(self.caches, dim=4)

    def close(self) -> None:
        for rank in self.others:
            rank.close()


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    made: list[Worker] = []
    yield made
    for worker in made:
        worker.close()


def pulls(src: Worker, dst: Worker, config: TransferConfig, moves: list[tuple[list[int], list[int]]],
          expect: TransferState = TransferState.DONE) -> None:
    """Pull each (source blocks, destination blocks) of `moves`, all started before the first poll; each ends
    `expect`, and the source is told PULLED (or, for a failed pull, that it may free its blocks)."""
    sender = make_sender(BackendName.NIXL, src.name, src.caches[0], config=config, **src.kwargs())
    receiver = make_receiver(BackendName.NIXL, dst.name, dst.caches[0], config=config, **dst.kwargs())
    try:
        assert sender.layout.fingerprint == receiver.layout.fingerprint
        assert len(sender.layout.ranks) == (len(src.caches) if len(src.caches) > 1 else 0)
        receiver.add_peer(sender.peer_info())
        for src_ids, dst_ids in moves:
            receiver.start_pull(sender.offer(src_ids, num_tokens=4 * len(src_ids)), dst_ids)
        results, released = [], []
        deadline = time.monotonic() + 10
        while len(results) + len(released) < 2 * len(moves) and time.monotonic() < deadline:
            results += receiver.poll()
            released += sender.poll()
        assert [r.state for r in results] == [expect] * len(moves), results
        reason = ReleaseReason.PULLED if expect == TransferState.DONE else ReleaseReason.FAILED
        assert [r.reason for r in released] == [reason] * len(moves)
    finally:
        receiver.close()
        sender.close()


@pytest.mark.parametrize("scratch", [64 << 20, 0], ids=["staged", "row-by-row"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), [(2, 1), (1, 2), (2, 2)])
def test_every_rank_pulls_its_heads_from_the_ranks_that_hold_them(src_tp: int, dst_tp: int, scratch: int,
                                                                  workers: list[Worker]) -> None:
    n = next(_names)
    src, dst = Worker(src_tp, f"p-ranks-{n}", seed=n), Worker(dst_tp, f"d-ranks-{n}", seed=None)
    workers += [src, dst]
    pulls(src, dst, TransferConfig(rank_scratch_bytes=scratch), [([1, 2, 5], [4, 0, 3])])
    assert torch.equal(dst.whole()[[4, 0, 3]], src.whole()[[1, 2, 5]])
    assert not dst.whole()[[1, 2, 5, 6, 7]].any()
    # The receiver closed: its other ranks dropped the peers' agents it had them load (their own live on).
    assert all(not rank._loaded for rank in dst.others)


def test_pulls_that_find_the_scratch_taken_read_row_by_row(workers: list[Worker]) -> None:
    n = next(_names)
    src, dst = Worker(1, f"p-ranks-{n}", seed=n), Worker(2, f"d-ranks-{n}", seed=None)
    workers += [src, dst]
    one_pull = 3 * src.caches[0][0].nbytes  # three whole-head source blocks
    moves = [([1, 2, 5], [4, 0, 3]), ([0, 3, 6], [1, 2, 5])]
    pulls(src, dst, TransferConfig(rank_scratch_bytes=one_pull), moves)
    assert torch.equal(dst.whole()[[4, 0, 3, 1, 2, 5]], src.whole()[[1, 2, 5, 0, 3, 6]])


def test_a_pull_larger_than_the_scratch_is_staged_range_by_range_not_row_by_row(
        workers: list[Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """Review P6: a pull the scratch cannot take whole went row by row (layers × 2 × block_size descriptors a
    block: 2 M for a 32k prompt of an 8B model); now it goes through a slot of the scratch, a range of blocks
    at a time, each range's heads copied out before the next is read into the same slot."""
    n = next(_names)
    src, dst = Worker(1, f"p-ranks-{n}", seed=n), Worker(2, f"d-ranks-{n}", seed=None)
    workers += [src, dst]
    posted: list[int] = []  # descriptors of each READ any rank posts
    read_descriptors = NixlAgent.read_descriptors

    def counted(self: NixlAgent, layout: Any, local: Any, agent_name: str, remote: Any) -> Any:
        posted.append(len(local))
        return read_descriptors(self, layout, local, agent_name, remote)

    monkeypatch.setattr(NixlAgent, "read_descriptors", counted)
    block = src.caches[0][0].nbytes  # a whole-head source block
    # Two blocks of scratch for pulls of three: each rank's slot holds one block (SLOT_SHARE).
    pulls(src, dst, TransferConfig(rank_scratch_bytes=2 * block), [([1, 2, 5], [4, 0, 3])])
    assert torch.equal(dst.whole()[[4, 0, 3]], src.whole()[[1, 2, 5]])
    assert not dst.whole()[[1, 2, 5, 6, 7]].any()
    assert posted == [1] * 6, posted  # both destination ranks, three ranges of one block each


def test_a_backend_that_stages_kv_refuses_ranks(workers: list[Worker]) -> None:
    worker = Worker(2, "torch-ranks", seed=None)
    workers.append(worker)
    with pytest.raises(ValueError, match="staging cache"):
        make_sender(BackendName.LOCAL, worker.name, worker.caches[0], ranks=worker.call_ranks)


class RefusingRank(RankTransfers):
    """A rank whose READs cannot be posted (as when NIXL refuses them)."""

    def handle(self, op: object) -> object:
        if isinstance(op, PostReads):
            return False
        return super().handle(op)


def test_a_rank_that_cannot_post_its_reads_fails_the_pull_and_frees_every_rank(workers: list[Worker]) -> None:
    n = next(_names)
    src, dst = Worker(1, f"p-ranks-{n}", seed=n), Worker(2, f"d-ranks-{n}", seed=None)
    workers += [src, dst]
    dst.others = [RefusingRank(dst.name, 1, 2, dst.caches[1])]
    pulls(src, dst, TransferConfig(), [([1, 2, 5], [4, 0, 3])], expect=TransferState.FAILED)
    assert not dst.others[0]._reads._posted  # type: ignore[union-attr]  # nothing left in flight



class RefusingOneRelease(RankTransfers):
    """A rank whose NIXL refuses to release one READ handle once (as when it cannot cancel it yet), and
    calls `on_refuse` then."""

    on_refuse: Any = None

    def _open(self, config: TransferConfig) -> Any:
        memory = super()._open(config)
        agent = self._started().agent
        release, refusals = agent.release, [True]

        def refusing(xfer: int) -> bool:
            if refusals and refusals.pop():
                self.on_refuse()
                return False
            return release(xfer)

        agent.release = refusing  # type: ignore[method-assign]
        return memory

    def close(self) -> None:  # the receiver's close: kept for the test to look after it
        pass


def test_a_release_nixl_refuses_once_does_not_copy_the_staged_heads_again(workers: list[Worker]) -> None:
    """Review LOW: a pull's staged heads were copied into the cache again at every poll while NIXL refused
    to release one of its READs, over whatever the blocks held by then (newer tokens, another request)."""
    n = next(_names)
    src, dst = Worker(1, f"p-ranks-{n}", seed=n), Worker(2, f"d-ranks-{n}", seed=None)
    workers += [src, dst]
    rank = RefusingOneRelease(dst.name, 1, 2, dst.caches[1])  # its heads are staged: the source holds all 3
    copied: list[torch.Tensor] = []

    def overwrite() -> None:  # the heads are copied by the time a release is asked: then written over
        copied.append(dst.caches[1][[4, 0, 3]].clone())
        dst.caches[1][[4, 0, 3]] = 7.0

    rank.on_refuse = overwrite
    dst.others = [rank]
    pulls(src, dst, TransferConfig(), [([1, 2, 5], [4, 0, 3])])
    assert torch.equal(dst.caches[0][[4, 0, 3]], src.caches[0][[1, 2, 5]][..., :2, :])
    assert torch.equal(copied[0], src.caches[0][[1, 2, 5]][..., 2:, :])  # rank 1's head, copied once
    assert bool((dst.caches[1][[4, 0, 3]] == 7.0).all())  # and not again after the refused release
    reads = rank._started()
    assert reads.poll() == {} and not reads._posted
    RankTransfers.close(rank)
