"""The engine's greedy output is token-identical to transformers `generate`.

Every test runs on the tiny random Llama (fast suite) and on SmolLM2-135M (marked slow, still run in CI):
(a) one request, (b) 8 requests of different lengths in one batch, (c) a prompt prefilled in chunks,
(d) requests sharing prefix blocks; plus preemption, bf16, abort. Each ends with the block pool whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from llm_engine import SamplingParams
from llm_engine.model_files import read_model_spec
from llm_engine.scheduler import Scheduler
from prefill_pool.scheduler import PrefillScheduler
from tests.helpers.engines import make_engine
from tests.helpers.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue("tiny_llama_dir" if request.param == "tiny" else "smollm2_dir")


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[tuple[int, ...], list[int]]:
    vocab = read_model_spec(model_dir).vocab_size
    prompts = random_prompts([7, 1, 16, 33, 64, 100, 250, 5, 48], vocab)
    shared = random_prompts([64], vocab, seed=7)[0]
    prompts += [[*shared, 11, 12, 13], [*shared, 21, 22]]
    outputs = hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    return {tuple(p): o for p, o in zip(prompts, outputs, strict=True)}


def test_single_request(model_dir: Path, reference: dict) -> None:
    engine = make_engine(model_dir)
    prompt = next(p for p in reference if len(p) == 33)
    [completion] = engine.generate([list(prompt)], GREEDY)
    assert list(completion.output_token_ids) == reference[prompt]
    assert completion.finish_reason == "length"
    assert engine.block_pool.is_whole()


def test_eight_requests_of_different_lengths_in_one_batch(model_dir: Path, reference: dict) -> None:
    engine = make_engine(model_dir)
    prompts = [list(p) for p in reference][:8]
    assert len({len(p) for p in prompts}) == 8
    completions = engine.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.output_token_ids) == reference[tuple(prompt)]
    assert engine.block_pool.is_whole()


def test_prompt_prefilled_in_several_chunks(model_dir: Path, reference: dict) -> None:
    # A 24-token budget cuts the 250-token prompt into 11 chunks, interleaved with the others' decodes.
    engine = make_engine(model_dir, max_num_batched_tokens=24)
    prompts = [list(p) for p in reference if len(p) in (250, 100, 7)]
    completions = engine.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.output_token_ids) == reference[tuple(prompt)]
    assert engine.block_pool.is_whole()


def test_request_sharing_prefix_blocks(model_dir: Path, reference: dict) -> None:
    engine = make_engine(model_dir)
    first, second = [list(p) for p in reference if len(p) in (66, 67)]
    [out_first] = engine.generate([first], GREEDY)
    hits_before = engine.block_pool.num_cached_blocks
    # The second prompt's 64-token prefix (4 blocks of 16) is served from the first one's cached blocks.
    assert len(engine.kv.find_cached_prefix(second)) == 4
    [out_second] = engine.generate([second], GREEDY)
    assert list(out_first.output_token_ids) == reference[tuple(first)]
    assert list(out_second.output_token_ids) == reference[tuple(second)]
    assert hits_before > 0
    assert engine.block_pool.is_whole()


def test_prefix_blocks_shared_while_both_run(model_dir: Path, reference: dict) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=70)
    first, second = [list(p) for p in reference if len(p) in (66, 67)]
    outputs: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)

    engine.add_request(first, GREEDY, request_id="a")
    step()  # prefill of "a" fills and caches its first 4 blocks
    engine.add_request(second, GREEDY, request_id="b")
    step()  # "b" prefills only its last 3 tokens on top of the 4 shared blocks
    shared = set(engine.kv.block_table("a")[:4]) & set(engine.kv.block_table("b")[:4])
    assert len(shared) == 4
    assert all(engine.block_pool.blocks[b].ref_count == 2 for b in shared)
    while engine.has_unfinished():
        step()
    assert outputs["a"] == reference[tuple(first)]
    assert outputs["b"] == reference[tuple(second)]
    assert engine.block_pool.is_whole()


def test_preemption_by_recompute_keeps_greedy_output(model_dir: Path, reference: dict) -> None:
    # 12 blocks of 16 tokens cannot hold all four requests to the end: the newest are preempted, re-queued
    # and recomputed, and still produce the reference tokens.
    engine = make_engine(model_dir, num_blocks=12, enable_prefix_caching=False)
    prompts = [list(p) for p in reference if len(p) in (33, 48, 64, 16)]
    completions = engine.generate(prompts, GREEDY)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert list(completion.output_token_ids) == reference[tuple(prompt)]
    assert sum(c.num_preemptions for c in completions) > 0
    assert engine.block_pool.is_whole()


def test_bfloat16_runs_and_frees(model_dir: Path) -> None:
    engine = make_engine(model_dir, dtype="bfloat16")
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    fixed_length = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    completions = engine.generate(random_prompts([10, 30], engine.spec.vocab_size), fixed_length)
    assert all(len(c.output_token_ids) == 24 for c in completions)
    assert engine.block_pool.is_whole()


def test_abort_frees_blocks(model_dir: Path) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=16)
    for index, prompt in enumerate(random_prompts([40, 40, 40], engine.spec.vocab_size)):
        engine.add_request(prompt, GREEDY, request_id=f"r{index}")
    engine.step()
    engine.step()
    assert engine.abort("r0") and engine.abort("r2")
    assert not engine.abort("r2")  # idempotent: already gone
    while engine.has_unfinished():
        engine.step()
    assert engine.block_pool.is_whole()


def test_a_new_scheduler_over_an_idle_engine_keeps_its_cache_and_serves_the_same(
        tiny_llama_dir: Path) -> None:
    """A worker changing role swaps its engine's scheduler: only an idle engine may, the prefix cache and
    the weights stay, the runner forgets the old tables, and the output is the same as before."""
    engine = make_engine(tiny_llama_dir)
    prompts = random_prompts([40, 23], engine.spec.vocab_size, seed=7)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    first = engine.generate(prompts, greedy)
    engine.add_request(prompts[0], greedy, request_id="busy")
    with pytest.raises(RuntimeError, match="drain it"):
        engine.use_scheduler(PrefillScheduler)
    engine.abort("busy")
    engine.step()  # the abort reaches the scheduler; its blocks come back
    cached = engine.block_pool.num_cached_blocks
    engine.use_scheduler(Scheduler, watermark=0.1)
    assert engine.runner.inputs.num_rows_in_use == 0 and engine.block_pool.num_cached_blocks == cached > 0
    assert [c.output_token_ids for c in engine.generate(prompts, greedy)] == [
        c.output_token_ids for c in first]
