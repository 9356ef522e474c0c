"""cache_salt (vLLM's field; review P3): a request's block hashes chain from its salt, so requests of
different salts share no cached block, on the worker that prefills and on the decode worker that received the
KV; the same salt shares as any repeated prompt; the salt changes no token."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

from llm_engine.block_pool import BlockPool
from llm_engine.kv_cache_manager import KVCacheManager, chain_root, prefix_hashes
from llm_engine.params import SamplingParams
from tests.helpers.engines import make_engine, make_pair, run_handoff

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_salted_chains_never_meet() -> None:
    tokens = list(range(64))
    unsalted, salted_a, salted_b = (prefix_hashes(tokens, 16, chain_root(s)) for s in (None, "a", "b"))
    assert len({*unsalted, *salted_a, *salted_b}) == 12  # no block hash in common, at any depth
    assert prefix_hashes(tokens, 16, chain_root("a")) == salted_a  # stable: a router predicts a worker's


def test_blocks_filled_under_a_salt_are_found_under_that_salt_only() -> None:
    kv = KVCacheManager(BlockPool(16), block_size=16)
    tokens = list(range(40))
    # A prompt computed here (allocate) and one received by transfer (allocate_blocks): both cache their
    # full blocks under their own salt's chain.
    kv.allocate("computed", tokens, 40, root=chain_root("a"))
    kv.cache_full_blocks("computed", tokens, 40)
    received = [t + 1000 for t in tokens]
    kv.allocate_blocks("received", 40, root=chain_root("b"))
    kv.cache_full_blocks("received", received, 40)
    for prompt, salt in ((tokens, "a"), (received, "b")):
        assert len(kv.find_cached_prefix(prompt, root=chain_root(salt))) == 2
        assert kv.find_cached_prefix(prompt, root=chain_root("other")) == []
        assert kv.find_cached_prefix(prompt) == []  # unsalted


def test_the_engine_shares_a_prefix_within_a_salt_only_and_the_tokens_are_the_same(tiny_llama_dir: Path
                                                                                   ) -> None:
    engine = make_engine(tiny_llama_dir)
    prompt = random.Random(7).choices(range(1000), k=50)

    def run(salt: str | None) -> tuple[int, tuple[int, ...]]:
        """(prompt tokens found cached, the output)."""
        request = engine.scheduler.requests[engine.add_request(prompt, replace(GREEDY, cache_salt=salt))]
        while not request.is_finished:
            engine.step()
        return request.num_cached_tokens, tuple(request.output_token_ids)

    runs = [run(None), run("tenant-a"), run("tenant-b"), run("tenant-a"), run(None)]
    assert [cached for cached, _ in runs] == [0, 0, 0, 48, 48]
    assert len({output for _, output in runs}) == 1
    assert engine.block_pool.is_whole()


def test_kv_handed_to_the_decode_worker_is_cached_there_under_the_requests_salt(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    prompt = random.Random(8).choices(range(1000), k=40)
    tokens = run_handoff(prefill, decode, [prompt], replace(GREEDY, cache_salt="tenant-a"))
    kv = decode.engine.kv
    # The prompt and the tokens decoded after it (their blocks filled on the decode worker).
    history = prompt + tokens["r0"]
    assert len(kv.find_cached_prefix(history, root=chain_root("tenant-a"))) == 2
    assert kv.find_cached_prefix(history) == [] and kv.find_cached_prefix(history, root=chain_root("b")) == []
