"""Prefill worker → local KV handoff → decode worker, in one process, stepped by hand (no Ray, no threads)."""

from __future__ import annotations

from pathlib import Path

import pytest

from decode_pool.messages import DecodeOutput, DecodeRequest
from llm_engine import SamplingParams
from llm_engine.tiny_model import TINY_FAMILIES, build_tiny_model
from prefill_pool.messages import PrefillRequest, PrefillResult
from tests.helpers.engines import make_pair
from tests.helpers.engines import run_handoff as run
from tests.helpers.reference import hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_greedy_tokens_match_transformers_and_pools_end_whole(tiny_llama_dir: Path) -> None:
    prompts = random_prompts([3, 17, 40, 100, 64, 9, 130, 33], 1000)
    prefill, decode = make_pair(tiny_llama_dir)
    tokens = run(prefill, decode, prompts)
    expected = hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.engine.block_pool.is_whole()
    assert decode.engine.block_pool.is_whole()


@pytest.mark.parametrize("family", sorted(set(TINY_FAMILIES) - {"llama"}))  # llama: the test above
def test_each_family_through_the_handoff_matches_transformers(family: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    prompts = random_prompts([3, 40, 19], 1000)
    sampling = SamplingParams(max_tokens=6, temperature=0.0)
    prefill, decode = make_pair(model_dir, budget=24)  # the 40-token prompt in two chunks
    tokens = run(prefill, decode, prompts, sampling)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == hf_greedy(model_dir, prompts, 6)
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def test_decode_preemption_keeps_greedy_tokens(tiny_llama_dir: Path) -> None:
    prompts = random_prompts([40, 50, 45, 60], 1000)
    prefill, decode = make_pair(tiny_llama_dir, decode_blocks=12)
    sampling = SamplingParams(max_tokens=30, temperature=0.0)
    tokens = run(prefill, decode, prompts, sampling)
    expected = hf_greedy(tiny_llama_dir, prompts, 30)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert decode.engine.block_pool.is_whole() and prefill.engine.block_pool.is_whole()


def test_single_token_requests_skip_decode(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    tokens = run(prefill, decode, random_prompts([20, 5], 1000), SamplingParams(max_tokens=1, temperature=0))
    assert all(len(t) == 1 for t in tokens.values())
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


@pytest.mark.parametrize("stage", ["queued", "prefilling", "awaiting_transfer", "decoding"])
def test_abort_at_each_stage_frees_both_pools(tiny_llama_dir: Path, stage: str) -> None:
    prefill, decode = make_pair(tiny_llama_dir, lease_s=0.2, budget=16)
    prompt = random_prompts([60], 1000)[0]
    results: list[PrefillResult] = []
    outputs: list[DecodeOutput] = []
    prefill.submit(PrefillRequest("r", tuple(prompt), GREEDY), results.append)
    if stage == "queued":
        prefill.abort("r")
    prefill.step()  # first 16-token chunk
    if stage == "prefilling":
        prefill.abort("r")
    while not results:
        prefill.step()
    if results[0].finish_reason != "abort":
        result = results[0]
        request = DecodeRequest("r", tuple(prompt), GREEDY, result.first_token_id, None, result.kv_handle)
        if stage == "awaiting_transfer":
            # The decode side never pulls: the lease runs out and the prefill side frees the blocks.
            while prefill.engine.block_pool.num_used_blocks:
                prefill.step()
        else:
            decode.submit(request, outputs.append)
            decode.step()
            decode.step()
            decode.abort("r")
            decode.step()
            assert outputs[-1].finish_reason == "abort"
            prefill.step()
    assert (results[0].finish_reason == "abort") == (stage in ("queued", "prefilling"))
    assert prefill.engine.block_pool.is_whole()
    assert decode.engine.block_pool.is_whole()


def test_abort_while_the_claim_waits_frees_the_decode_blocks_without_the_sender(tiny_llama_dir: Path) -> None:
    """NIXL: the decode worker has claimed the KV and the prefill side has not answered (it is busy, or it
    withdrew the lease and is not polling); an abort frees the decode blocks at the next step, not at the
    pull's deadline, and the prefill side frees its own blocks once it hears of it."""
    pytest.importorskip("nixl._bindings")
    prefill, decode = make_pair(tiny_llama_dir, backend="nixl")
    prompt = random_prompts([60], 1000)[0]
    results: list[PrefillResult] = []
    outputs: list[DecodeOutput] = []
    prefill.submit(PrefillRequest("r", tuple(prompt), GREEDY), results.append)
    while not results:
        prefill.step()
    result = results[0]
    decode.submit(DecodeRequest("r", tuple(prompt), GREEDY, result.first_token_id, None, result.kv_handle),
                  outputs.append)
    decode.step()  # the pull starts: its claim is sent, and nobody answers it
    assert decode.load().num_transferring == 1

    decode.abort("r")
    decode.step()

    assert outputs[-1].finish_reason == "abort"
    assert decode.engine.block_pool.is_whole()
    prefill.release_kv(result.kv_handle.transfer_id, "the client left")  # what the gateway sends
    for _ in range(1000):
        prefill.step()
        if prefill.engine.block_pool.is_whole():
            break
    assert prefill.engine.block_pool.is_whole()


def test_decode_admission_keeps_the_watermark(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir, decode_blocks=20)
    decode.engine.scheduler.watermark_blocks = 5
    results: list[PrefillResult] = []
    prompts = random_prompts([96, 96, 96], 1000)  # 6 blocks each
    for index, prompt in enumerate(prompts):
        prefill.submit(PrefillRequest(f"r{index}", tuple(prompt), GREEDY), results.append)
    while len(results) < 3:
        prefill.step()
    outputs: list[DecodeOutput] = []
    for result, prompt in zip(results, prompts, strict=True):
        decode.submit(DecodeRequest(result.request_id, tuple(prompt), GREEDY, result.first_token_id, None,
                                    result.kv_handle), outputs.append)
    decode.step()
    # First: nothing else running, admitted. Second: 6 + 5 reserve <= 14 free. Third: 6 + 5 > 8 free: waits.
    load = decode.load()
    assert load.num_waiting == 1 and load.num_running == 2
    while sum(1 for o in outputs if o.finish_reason) < 3:
        decode.step()
        prefill.step()
    assert decode.engine.block_pool.is_whole() and prefill.engine.block_pool.is_whole()
