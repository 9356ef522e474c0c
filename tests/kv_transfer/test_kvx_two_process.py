"""Two real processes (spawn), one sender and one receiver, for the nixl and torch (gloo) backends."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import msgpack
import pytest

from tests.kv_transfer.kvx_harness import Pair, PeerError, start_pair

SRC_BLOCKS, DST_BLOCKS = 40, 64
# (source ids, destination ids): one block, scattered ids, and runs mixed with gaps, both sides differing.
# Destination ids are disjoint across tests (the module shares one receiver), so "untouched" means zero.
_rng = random.Random(0)
_USED_DST = (47, 0, 40, 12, 13, 14, 7, 33, 20, 21, 30, 31, 34, 35, 36, 37, 38, 39)  # by the tests below
_FREE_DST = [b for b in range(60) if b not in _USED_DST]  # 60+: records
CASES = [
    ([5], [47]),
    ([9, 2, 30, 17, 3, 8, 1], [0, 40, 12, 13, 14, 7, 33]),
    (sorted(_rng.sample(range(SRC_BLOCKS), 24)), _rng.sample(_FREE_DST, 24)),
]


def _backends() -> list[str]:
    return ["nixl", "torch"]


def _prefill_options(**config) -> dict:
    return {"num_blocks": SRC_BLOCKS, "fill_seed": 1, "config": config}


def _decode_options(**extra) -> dict:
    return {"num_blocks": DST_BLOCKS, **extra}


@pytest.fixture(scope="module")
def started_pairs() -> Iterator[dict[str, Pair]]:
    """One sender and one receiver per backend for the whole module, each started by its first test. Not a
    module-scoped parametrized fixture: the tests that name one backend (indirect) would make pytest stop and
    start it again around them (6 starts of about 2.7 s for 2)."""
    pairs: dict[str, Pair] = {}
    yield pairs
    for started in pairs.values():
        started.decode.stop()
        started.prefill.stop()


@pytest.fixture(params=_backends())
def pair(request: pytest.FixtureRequest, started_pairs: dict[str, Pair]) -> tuple[str, Pair]:
    backend = request.param
    if backend not in started_pairs:
        if backend == "nixl":
            pytest.importorskip("nixl._bindings")
        started = start_pair(backend, _prefill_options(), _decode_options())
        started.decode.call("add_peer", started.prefill.call("peer_info"))
        started_pairs[backend] = started
    return backend, started_pairs[backend]


def _transfer_id(handle: bytes) -> int:
    return int(msgpack.unpackb(handle)["transfer_id"])


@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), CASES, ids=["1-block", "scattered", "runs"])
def test_pulled_blocks_are_bit_identical_and_released(pair: tuple[str, Pair], src, dst):
    _backend, p = pair
    assert p.decode.call("is_zero", dst)
    handle = p.prefill.call("offer", src, 16 * len(src), 30.0)

    state, reason = p.pull(handle, dst)

    assert (state, reason) == ("DONE", "")
    assert p.decode.call("checksum", dst) == p.prefill.call("checksum", src)
    assert p.wait_released(_transfer_id(handle)) == (src, "PULLED")
    assert p.prefill.call("num_outstanding") == 0


@pytest.mark.slow
def test_expired_lease_releases_blocks_and_late_pull_fails(pair: tuple[str, Pair]):
    _backend, p = pair
    src, dst = [11, 4], [20, 21]
    handle = p.prefill.call("offer", src, 20, 0.2)

    assert p.wait_released(_transfer_id(handle)) == (src, "EXPIRED")
    state, reason = p.pull(handle, dst)

    assert state == "FAILED" and "lease" in reason
    assert p.decode.call("is_zero", dst)  # nothing was written
    assert p.prefill.call("num_outstanding") == 0


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["torch"], indirect=True)  # only the torch sender takes part in a pull
def test_torch_sender_refuses_a_pull_whose_lease_ended_in_flight(pair: tuple[str, Pair]):
    _backend, p = pair
    src, dst = [12, 13], [30, 31]
    handle = p.prefill.call("offer", src, 20, 0.5)
    p.decode.call("start_pull", handle, dst)
    requests = p.decode.call("take_requests")
    p.wait_released(_transfer_id(handle))  # the lease expires while the request is "on the wire"

    reply = p.prefill.call("accept", requests[0])
    p.decode.call("on_reply", reply)
    ((_, state, reason),) = p.decode.call("receiver_poll")

    assert state == "FAILED" and "refused" in reason
    assert p.decode.call("is_zero", dst)


@pytest.mark.slow
def test_records_cover_every_transfer_on_both_sides(pair: tuple[str, Pair]):
    _backend, p = pair
    pulled = p.prefill.call("offer", [0, 1], 32, 30.0)
    assert p.pull(pulled, [60, 61])[0] == "DONE"
    expired = p.prefill.call("offer", [2], 16, 0.1)
    p.wait_released(_transfer_id(expired))
    assert p.pull(expired, [62])[0] == "FAILED"
    p.wait_released(_transfer_id(pulled))

    sent = {tid: (outcome, size) for tid, outcome, size in p.prefill.call("records")}
    received = {tid: (outcome, size) for tid, outcome, size in p.decode.call("records")}

    block_bytes = 737_280
    assert sent[_transfer_id(pulled)] == ("PULLED", 2 * block_bytes)
    assert sent[_transfer_id(expired)] == ("EXPIRED", block_bytes)
    assert received[_transfer_id(pulled)] == ("DONE", 2 * block_bytes)
    assert received[_transfer_id(expired)] == ("FAILED", block_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
def test_incompatible_layout_is_refused_before_any_byte_moves(backend: str):
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    p = start_pair(backend, _prefill_options(), _decode_options(head_dim=32))
    try:
        with pytest.raises(PeerError) as error:
            p.decode.call("add_peer", p.prefill.call("peer_info"))
        assert error.value.type_name == "IncompatibleLayoutError"
        assert "head_dim" in str(error.value)
    finally:
        p.decode.stop()
        p.prefill.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
def test_eight_bit_blocks_move_bit_identical(backend: str):
    """--kv-cache-dtype fp8 on both sides: the blocks are their bytes (gloo sends no float8: the torch backend
    moves bytes), half a bfloat16 block's."""
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    eight_bit = "float8_e4m3fn"
    p = start_pair(backend, {**_prefill_options(), "dtype": eight_bit}, _decode_options(dtype=eight_bit))
    try:
        p.decode.call("add_peer", p.prefill.call("peer_info"))
        src, dst = [3, 4, 9], [10, 11, 50]
        handle = p.prefill.call("offer", src, 16 * len(src), 30.0)
        assert p.pull(handle, dst) == ("DONE", "")
        assert p.decode.call("checksum", dst) == p.prefill.call("checksum", src)
        assert not p.decode.call("is_zero", dst)
    finally:
        p.decode.stop()
        p.prefill.stop()


@pytest.mark.slow
@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize(("source", "wire", "destination"), [("bfloat16", "", "float8_e4m3fn"),
                                                             ("float8_e4m3fn", "", "bfloat16"),
                                                             ("bfloat16", "float8_e4m3fn", "bfloat16")])
def test_blocks_convert_into_the_receivers_element_type(backend: str, source: str, wire: str,
                                                        destination: str):
    """A bfloat16 prefill worker and an fp8 decode worker (or the reverse) peer and hand off: the source's
    bytes cross as they are (the wire carries its type) and land converted in the receiver's cache. With a
    wire dtype (--kv-transfer-dtype fp8) two bfloat16 caches exchange fp8 bytes."""
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    p = start_pair(backend, {**_prefill_options(wire_dtype=wire), "dtype": source},
                   _decode_options(dtype=destination))
    try:
        p.decode.call("add_peer", p.prefill.call("peer_info"))
        src, dst = [3, 4, 9, 10, 11], [12, 13, 50, 2, 1]
        handle = p.prefill.call("offer", src, 16 * len(src), 30.0)
        assert p.pull(handle, dst) == ("DONE", "")
        expected = p.prefill.call("converted_checksum", src, destination, wire)
        assert p.decode.call("checksum", dst) == expected
        assert not p.decode.call("is_zero", dst)
        source_bytes = {"bfloat16": 2, "float8_e4m3fn": 1}[wire or source]
        (record,) = p.decode.call("records")
        assert record[2] == len(src) * source_bytes * 30 * 2 * 16 * 3 * 64  # the wire's bytes: the source's
    finally:
        p.decode.stop()
        p.prefill.stop()


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["nixl"], indirect=True)  # the progress thread is NIXL's
def test_nixl_agent_stays_off_the_cpu_when_idle(pair: tuple[str, Pair]):
    _backend, p = pair
    # CPU-seconds per second over ~1 s with both agents alive and connected; a spinning thread gives ~1.0.
    assert p.prefill.call("idle_cpu", 1.0) < 0.2
    assert p.decode.call("idle_cpu", 1.0) < 0.2


def _results(p: Pair, count: int, timeout: float = 30.0) -> dict[int, tuple[str, str]]:
    """Drive both sides (carrying pull requests and replies in order) until `count` pulls have finished."""
    results: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    while len(results) < count and time.monotonic() < deadline:
        for request in p.decode.call("take_requests"):
            p.decode.call("on_reply", p.prefill.call("accept", request))
        results.update({tid: (state, reason) for tid, state, reason in p.decode.call("receiver_poll")})
        p.poll_sender()
        time.sleep(0.002)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["torch"], indirect=True)  # only torch has pull replies
def test_torch_replies_delivered_out_of_order_land_in_their_own_blocks(pair: tuple[str, Pair]):
    _backend, p = pair
    first, second = p.prefill.call("offer", [14, 15], 32, 30.0), p.prefill.call("offer", [16, 17], 32, 30.0)
    p.decode.call("start_pull", first, [34, 35])
    p.decode.call("start_pull", second, [36, 37])
    replies = [p.prefill.call("accept", request) for request in p.decode.call("take_requests")]

    for reply in reversed(replies):  # concurrent actor calls: the later send's reply arrives first
        p.decode.call("on_reply", reply)
    results = _results(p, 2)

    assert results == {_transfer_id(first): ("DONE", ""), _transfer_id(second): ("DONE", "")}
    assert p.decode.call("checksum", [34, 35]) == p.prefill.call("checksum", [14, 15])
    assert p.decode.call("checksum", [36, 37]) == p.prefill.call("checksum", [16, 17])


@pytest.mark.slow
def test_a_withdrawn_transfer_is_refused_to_a_later_pull(pair: tuple[str, Pair]):
    _backend, p = pair
    handle = p.prefill.call("offer", [18], 16, 30.0)

    assert p.prefill.call("withdraw", _transfer_id(handle), "request aborted") == [
        (_transfer_id(handle), [18], "WITHDRAWN")]
    state, reason = p.pull(handle, [38])

    assert state == "FAILED" and "refused" in reason
    assert p.decode.call("is_zero", [38])
    assert p.prefill.call("num_outstanding") == 0
    assert p.prefill.call("withdraw", _transfer_id(handle), "again") == []  # nothing left to free


@pytest.mark.slow
def test_the_senders_clock_decides_expiry_even_if_the_receivers_disagrees(pair: tuple[str, Pair]):
    _backend, p = pair
    handle = p.prefill.call("offer", [19], 16, 0.2)
    assert p.wait_released(_transfer_id(handle)) == ([19], "EXPIRED")  # by the sender's clock
    # Clock skew: the receiver's clock is far behind, so by its own reckoning the lease has an hour to go.
    fields = msgpack.unpackb(handle)
    skewed = msgpack.packb({**fields, "lease_deadline": fields["lease_deadline"] + 3600}, use_bin_type=True)

    state, reason = p.pull(skewed, [39])

    assert state == "FAILED" and "refused" in reason
    assert p.decode.call("is_zero", [39])  # the freed source block was never read
    assert p.prefill.call("num_outstanding") == 0
