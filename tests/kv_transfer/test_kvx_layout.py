"""Layout description, compatibility fingerprint, msgpack wire format and transfer records."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import (
    BackendName,
    IncompatibleLayoutError,
    KVHandle,
    PeerInfo,
    PullReply,
    ReleasedBlocks,
    ReleaseReason,
    TransferRecord,
    TransferRecorder,
    TransferResult,
    TransferState,
    layout_from_tensor,
    wire,
)
from kv_transfer.layout import check_compatible, converts


def _cache(num_blocks: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], the default model's shape
    return torch.zeros(num_blocks, 30, 2, 16, 3, head_dim, dtype=dtype)


def test_layout_of_the_default_model():
    kv_cache = _cache()
    layout = layout_from_tensor(kv_cache)
    assert layout.block_bytes == 737_280
    assert (layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim) == (30, 16, 3, 64)
    assert (layout.dtype, layout.device, layout.num_blocks) == ("float32", "cpu", 4)
    assert layout.block_address(3) == kv_cache[3].data_ptr()
    with pytest.raises(IndexError):
        layout.block_address(4)


def test_fingerprint_ignores_addresses_and_block_count_but_not_shape_or_dtype():
    base = layout_from_tensor(_cache(4))
    assert layout_from_tensor(_cache(9)).fingerprint == base.fingerprint
    assert layout_from_tensor(_cache(4, head_dim=32)).fingerprint != base.fingerprint
    assert layout_from_tensor(_cache(4, dtype=torch.bfloat16)).fingerprint != base.fingerprint


def test_incompatible_layouts_are_refused_naming_the_fields():
    with pytest.raises(IncompatibleLayoutError, match="dtype: source 'float32' != destination 'int8'"):
        check_compatible(layout_from_tensor(_cache()), layout_from_tensor(_cache(dtype=torch.int8)))
    # Float types convert, the geometry must still match (and only it is named: the bytes differ anyway).
    with pytest.raises(IncompatibleLayoutError, match=r"^[^;]*head_dim: source 64 != destination 32$"):
        check_compatible(layout_from_tensor(_cache()), layout_from_tensor(_cache(head_dim=32,
                                                                                  dtype=torch.bfloat16)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_float_layouts_of_one_geometry_convert(dtype: torch.dtype):
    source, destination = layout_from_tensor(_cache()), layout_from_tensor(_cache(dtype=dtype))
    check_compatible(source, destination)
    check_compatible(destination, source)
    assert converts(source, destination) and converts(destination, source)
    assert not converts(source, source)


def test_non_contiguous_or_misshapen_caches_are_rejected():
    with pytest.raises(ValueError, match="contiguous"):
        layout_from_tensor(_cache().transpose(0, 1))
    with pytest.raises(ValueError, match="blocks, layers, 2"):
        layout_from_tensor(torch.zeros(4, 30, 3, 16, 3, 64))


def test_messages_round_trip_through_msgpack():
    layout = layout_from_tensor(_cache())
    messages = [
        PeerInfo("prefill-0", "host", 12, BackendName.NIXL, layout, b"\x00agent-md"),
        KVHandle("prefill-0", 7, (3, 1, 2), 40, layout.fingerprint, BackendName.TORCH, 1.7e9),
        PullReply("prefill-0", 7, is_accepted=False, reason="lease expired", send_seq=-1, num_blocks=0),
        PullReply("prefill-0", 8, is_accepted=True, reason="", send_seq=3, num_blocks=2),
        ReleasedBlocks(7, (3, 1), ReleaseReason.EXPIRED),
        TransferResult("prefill-0", 7, (5, 6), TransferState.FAILED, "deadline"),
    ]
    for message in messages:
        assert wire.decode(type(message), wire.encode(message)) == message


def test_recorder_is_bounded_and_calls_back():
    seen: list[TransferRecord] = []
    recorder = TransferRecorder(capacity=2, callback=seen.append)
    records = [TransferRecord("recv", BackendName.LOCAL, "p", i, 1, 10, 0.1, "DONE", "") for i in range(3)]
    for record in records:
        recorder.add(record)
    assert recorder.records == records[1:]
    assert seen == records


def test_runs_consecutive_on_both_sides_are_coalesced():
    from kv_transfer.layout import coalesce_runs

    runs = coalesce_runs((4, 5, 6, 9, 10, 2), (0, 1, 2, 3, 7, 8))
    assert runs == [(4, 0, 3), (9, 3, 1), (10, 7, 1), (2, 8, 1)]
    assert coalesce_runs((), ()) == []
