"""Several choices of one prompt (n > 1) in the engine: the block accounting of a fork (plain Python), and the
two-stage way through two engines (one prefills and draws n first tokens, the other receives the KV once,
forks it and decodes n streams), each choice equal to a single request with that choice's seed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from llm_engine import BlockPool, KVCacheManager, LLMEngine
from llm_engine.choices import choice_request_id
from llm_engine.params import SamplingParams, choice_seed
from llm_engine.request import Request
from prefill_pool.scheduler import PrefillScheduler
from tests.helpers.engines import make_engine
from tests.helpers.reference import random_prompts

BLOCK = 16


def test_a_fork_shares_full_blocks_and_copies_the_partial_one() -> None:
    pool = BlockPool(32)
    kv = KVCacheManager(pool, BLOCK)
    parent = kv.allocate_blocks("p", 40)  # 2 full blocks + 8 tokens in a third
    assert kv.num_fork_blocks(40, 3) == 2
    copies = kv.fork("p", ["c0", "c1", "c2"], 40)
    assert not kv.has("p")
    assert kv.block_table("c0") == parent  # the first child takes the parent's own blocks
    assert [src for src, _ in copies] == [parent[2], parent[2]]
    for child, (_, copy) in zip(("c1", "c2"), copies, strict=True):
        assert kv.block_table(child) == [*parent[:2], copy]
    assert [pool.blocks[b].ref_count for b in parent] == [3, 3, 1]
    assert pool.num_used_blocks == 3 + 2  # the prompt once, plus one partial copy per extra choice
    for child in ("c0", "c1", "c2"):
        kv.free(child)
    assert pool.is_whole()


def test_a_fork_of_whole_blocks_copies_nothing() -> None:
    pool = BlockPool(8)
    kv = KVCacheManager(pool, BLOCK)
    parent = kv.allocate_blocks("p", 32)
    assert kv.fork("p", ["a", "b"], 32) == []
    assert kv.block_table("a") == kv.block_table("b") == parent
    kv.free("a")
    kv.free("b")
    assert pool.is_whole()


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> tuple[LLMEngine, LLMEngine]:
    prefill = make_engine(tiny_llama_dir)
    prefill.use_scheduler(PrefillScheduler)
    return prefill, make_engine(tiny_llama_dir)


def two_stage(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], sampling: SamplingParams
              ) -> list[list[int]]:
    """Prefill with n choices on one engine, hand the KV to the other once, fork, decode every choice."""
    prefill.add_request(prompt, replace(sampling, max_tokens=1), "r")
    while not (advanced := prefill.scheduler.update(batch := prefill.scheduler.schedule(),
                                                    prefill.runner.execute(batch))):
        pass
    [request] = advanced
    firsts = [request.output_token_ids[0], *(t.token_id for t in request.other_first_tokens)]
    assert len(firsts) == sampling.n
    src = prefill.kv.block_table("r")
    dst = decode.kv.allocate_blocks("r", len(prompt))
    decode.runner.kv_cache[dst] = prefill.runner.kv_cache[src]  # the transfer, in one process
    prefill.kv.free("r")
    ids = [choice_request_id("r", i) for i in range(sampling.n)]
    decode.fork_blocks("r", ids, len(prompt))
    eos = frozenset(decode.spec.eos_token_ids)
    choices = []
    for i, (choice_id, first) in enumerate(zip(ids, firsts, strict=True)):
        choice = Request(choice_id, list(prompt), sampling.for_choice(i), eos, output_token_ids=[first])
        choice.num_computed_tokens = len(prompt)
        decode.scheduler.add_running(choice)
        choices.append(choice)
    while decode.has_unfinished():
        decode.step()
    assert prefill.block_pool.is_whole() and decode.block_pool.is_whole()
    return [c.output_token_ids for c in choices]


@pytest.mark.parametrize("length", [40, 48])  # a partial last block, and whole blocks only
def test_greedy_choices_are_all_the_single_request(engines: tuple[LLMEngine, LLMEngine], length: int) -> None:
    prefill, decode = engines
    prompt = random_prompts([length], prefill.spec.vocab_size, seed=3)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [alone] = decode.generate([prompt], greedy)
    assert two_stage(prefill, decode, prompt, replace(greedy, n=3)) == [list(alone.output_token_ids)] * 3


def test_seeded_choices_are_each_their_seed_s_single_request(engines: tuple[LLMEngine, LLMEngine]) -> None:
    prefill, decode = engines
    prompt = random_prompts([37], prefill.spec.vocab_size, seed=4)[0]
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True, n=3)
    served = two_stage(prefill, decode, prompt, seeded)
    alone = decode.generate([prompt] * 3, [replace(seeded, n=1, seed=choice_seed(1234, i)) for i in range(3)])
    assert served == [list(c.output_token_ids) for c in alone]
    assert alone[0].output_token_ids == decode.generate([prompt], replace(seeded, n=1))[0].output_token_ids
    assert len({tuple(c) for c in served}) > 1
    assert two_stage(prefill, decode, prompt, seeded) == served  # reproducible
