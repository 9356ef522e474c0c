"""The runner's persistent block tables and vectorised metadata, against a per-token reference; the batched
sampler's filters against the one-row path."""

from __future__ import annotations

import pytest
import torch

from llm_engine.batch import ModelInput, ScheduledChunk
from llm_engine.input_batch import InputBatch
from llm_engine.params import SamplingParams
from llm_engine.sampling import _filter_rows, _filter_top_k_top_p, sample

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0)


def make(num_rows: int = 2) -> InputBatch:
    # kv_cache: [num_blocks, layers, 2, block_size, kv_heads, head_dim]
    return InputBatch(torch.zeros(32, 1, 2, BLOCK, 1, 2), max_blocks_per_seq=8, max_num_tokens=4,
                      num_rows=num_rows)


def chunk(request_id: str, start: int, num: int, new_blocks: tuple[int, ...], prior: int,
          sampling: SamplingParams | None = GREEDY) -> ScheduledChunk:
    return ScheduledChunk(request_id, tuple(range(100 + start, 100 + start + num)), start, new_blocks, prior,
                          sampling)


def test_metadata_matches_a_per_token_reference() -> None:
    inputs = make()
    tables = {"a": [3, 5], "b": [7, 8, 9], "c": [11, 12]}
    first = ModelInput((chunk("a", 0, 6, (3, 5), 0), chunk("b", 0, 4, (7,), 0, None),
                        chunk("c", 0, 5, (11, 12), 0)))
    inputs.prepare(first)
    # a decodes, b continues its prompt over a cached context (gains blocks 8, 9), c decodes.
    second = ModelInput((chunk("a", 6, 1, (), 2), chunk("b", 4, 6, (8, 9), 1), chunk("c", 5, 1, (), 2)))
    prepared = inputs.prepare(second)
    positions = [6, *range(4, 10), 5]
    owners = ["a"] + ["b"] * 6 + ["c"]
    assert prepared.position_ids[0].tolist() == positions
    assert prepared.input_ids[0].tolist() == [106, *range(104, 110), 105]
    meta = prepared.metadata
    blocks = [tables[o][p // BLOCK] for o, p in zip(owners, positions, strict=True)]
    assert meta.slot_blocks.tolist() == blocks
    # kv_cache viewed as [32 * 1 layer * 2 * BLOCK, 2]: a block is 2 * BLOCK rows, K first.
    offsets = [p % BLOCK for p in positions]
    assert meta.slot_rows.tolist() == [b * 2 * BLOCK + o for b, o in zip(blocks, offsets, strict=True)]
    assert meta.slot_offsets.tolist() == [p % BLOCK for p in positions]
    k_rows, v_rows = meta.layer_slot_rows  # one layer: its K rows, then its V rows (a block's K, then V)
    assert k_rows.tolist() == meta.slot_rows.tolist()
    assert v_rows.tolist() == [row + BLOCK for row in meta.slot_rows.tolist()]
    [segment] = meta.prefills
    assert (segment.q_start, segment.q_len, segment.context_len) == (1, 6, 10)
    assert segment.block_ids is not None and segment.block_ids.tolist() == tables["b"]
    decode = meta.decode
    assert decode is not None and decode.q_indices.tolist() == [0, 7]  # type: ignore[union-attr]
    assert decode.num_keys == 7 and decode.block_tables.view(2, -1)[:, :2].tolist() == [[3, 5], [11, 12]]
    assert decode.gathered_shape[:2] == (2, decode.block_tables.numel() // 2 * BLOCK)
    assert decode.mask is not None  # contexts 7 and 6: the shorter row's last key is masked
    assert decode.mask[:, 0, 0].isinf().tolist() == [[False] * 7, [False] * 6 + [True]]
    assert prepared.sample_rows is not None and prepared.sample_rows.tolist() == [0, 6, 7]


def test_rows_are_reused_grown_and_restarted() -> None:
    inputs = make(num_rows=1)
    inputs.prepare(ModelInput((chunk("a", 0, 2, (1,), 0), chunk("b", 0, 2, (2,), 0))))  # grows to 2 rows
    assert inputs.num_rows_in_use == 2
    # "a" was preempted and comes back with a new table; "b" finished.
    prepared = inputs.prepare(ModelInput((chunk("a", 0, 3, (6,), 0),), finished_request_ids=("a", "b")))
    assert prepared.metadata.slot_blocks.tolist() == [6, 6, 6]
    assert inputs.num_rows_in_use == 1
    prepared = inputs.prepare(ModelInput((chunk("a", 3, 1, (), 1),)))
    assert prepared.metadata.decode is not None and prepared.metadata.decode.mask is None
    assert isinstance(prepared.metadata.decode.q_indices, slice) and prepared.sample_rows is None


def test_a_table_the_runner_does_not_hold_is_an_error() -> None:
    inputs = make()
    with pytest.raises(RuntimeError, match="table"):
        inputs.prepare(ModelInput((chunk("x", 4, 1, (), 1),)))
    inputs.prepare(ModelInput((chunk("y", 0, 4, (1,), 0),)))
    with pytest.raises(RuntimeError, match="past its request's block table"):
        inputs.prepare(ModelInput((chunk("y", 4, 1, (), 1),)))  # position 4 needs a second block


def test_batched_filters_equal_the_one_row_filter() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    settings = [(0, 1.0), (3, 1.0), (0, 0.6), (10, 0.3), (50, 0.999)]
    batched = _filter_rows(logits, torch.tensor([k for k, _ in settings]),
                           torch.tensor([p for _, p in settings]))
    for row, (k, p) in enumerate(settings):
        assert torch.equal(batched[row], _filter_top_k_top_p(logits[row], k, p))


def test_unseeded_rows_sampled_together_respect_their_filters() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    params = [SamplingParams(top_p=0.7), GREEDY, SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(temperature=1e-45)]
    seen: list[set[int]] = [set(), set(), set(), set()]
    for _ in range(200):
        for row, token in enumerate(sample(logits, params, [0] * 4)[0]):
            seen[row].add(token)
    assert seen == [{0, 1}, {0}, {0}, {0}]  # the overflowing temperature falls back to the argmax
