"""Tensor parallelism inside one engine: rank 0 schedules and samples, the other ranks replay its steps over
their slice of the heads, MLP and KV cache (llm_engine/tensor_parallel.py); float32 greedy tokens equal one
rank's."""

from __future__ import annotations

import contextlib
import os
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from decode_pool.worker import DecodeWorker
from kv_transfer import TransferConfig, make_receiver, make_sender
from llm_engine import EngineConfig, LLMEngine, ModelSpec
from llm_engine.checkpoint_config import read_lean_config
from llm_engine.lean_loader import load_lean_model
from llm_engine.model_files import read_model_spec
from llm_engine.params import SamplingParams
from llm_engine.rank_shares import RankShare, check_tensor_parallel, rank_shares, spec_shares, vocab_rows
from llm_engine.tensor_parallel import TPGroup
from llm_engine.tiny_model import build_tiny_model
from llm_engine.tp_sharding import VocabParallelHead
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import PrefillWorker
from tests.helpers.engines import run_handoff
from tests.helpers.tp_ranks import other_ranks

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
# A short prompt, one longer than a prefill chunk (32 tokens below), and two that share a cached prefix.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 90)), [5] * 40 + [6, 7], [5] * 40 + [8]]


def smollm2_like(**fields: int) -> ModelSpec:
    shape = {"num_heads": 9, "num_kv_heads": 3, "intermediate_size": 1536, **fields}
    return ModelSpec("LlamaForCausalLM", num_layers=30, head_dim=64, hidden_size=576, vocab_size=49152,
                     max_model_len=2048, eos_token_ids=(2,), **shape)


@pytest.mark.parametrize(("size", "named"), [
    (4, "--tensor-parallel-size 4 does not split the model's 9 attention heads and 3 KV heads"),
    (5, "degrees that do: 1, 2, 3, 9"),
    (0, "--tensor-parallel-size must be >= 1, got 0"),
])
def test_a_degree_that_does_not_split_the_heads_is_refused_naming_the_flag(size: int, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_tensor_parallel(smollm2_like(), size)
    check_tensor_parallel(smollm2_like(), 3)  # 9 / 3 and 3 / 3: even
    check_tensor_parallel(smollm2_like(), 2)  # 6 + 3 heads, 2 + 1 KV heads
    check_tensor_parallel(smollm2_like(), 9)  # a query head each, each KV head on 3 ranks


def test_shares_are_as_even_as_they_go_with_each_kv_heads_query_heads() -> None:
    assert rank_shares(9, 3, 1536, 2) == [RankShare(0, 2, 0, 6, 0, 768), RankShare(2, 1, 6, 3, 768, 768)]
    assert rank_shares(8, 2, 512, 2) == [RankShare(0, 1, 0, 4, 0, 256), RankShare(1, 1, 4, 4, 256, 256)]
    assert rank_shares(6, 3, 101, 3) == [RankShare(0, 1, 0, 2, 0, 34), RankShare(1, 1, 2, 2, 34, 34),
                                         RankShare(2, 1, 4, 2, 68, 33)]
    # Past one rank per KV head: KV head 0 on ranks 0 and 1, KV head 1 on ranks 2 and 3; 2 query heads each.
    assert [(s.kv_start, s.num_kv_heads, s.q_start, s.num_heads) for s in rank_shares(8, 2, 512, 4)] == [
        (0, 1, 0, 2), (0, 1, 2, 2), (1, 1, 4, 2), (1, 1, 6, 2)]


@pytest.mark.parametrize(("model", "size", "tied"), [("even", 2, False), ("even", 4, False),
                                                      ("uneven", 2, False), ("even", 2, True)])
def test_each_rank_reads_only_its_slice_of_the_checkpoint(request: pytest.FixtureRequest, tmp_path: Path,
                                                          model: str, size: int, tied: bool) -> None:
    """A rank's layers, read sliced from the files, are its rows and columns of the whole ones (q/k/v and
    gate/up rows, o and down columns), with its heads, and its rows of the lm_head (tied or not)."""
    model_dir = (build_tiny_model("llama", tmp_path, tie_word_embeddings=True) if tied else
                 request.getfixturevalue("tiny_llama_dir" if model == "even" else "three_kv_heads_dir"))
    lean, cpu = read_lean_config(model_dir), torch.device("cpu")
    assert not isinstance(lean, str)
    whole = load_lean_model(lean, model_dir, torch.float32, cpu, 64)
    for rank, share in enumerate(spec_shares(read_model_spec(model_dir), size)):
        part = load_lean_model(lean, model_dir, torch.float32, cpu, 64, share, rank, size)
        for full, mine in zip(whole.lean_body.layers, part.lean_body.layers, strict=True):
            q_rows, kv_rows = share.q_rows(full.head_dim), share.kv_rows(full.head_dim)
            q, k, v = full.qkv_proj.weight.split([full.q_size, full.kv_size, full.kv_size])
            assert torch.equal(mine.qkv_proj.weight, torch.cat([q[q_rows], k[kv_rows], v[kv_rows]]))
            gate, up = full.gate_up_proj.weight.split(full.intermediate)
            mlp = share.mlp_rows
            assert torch.equal(mine.gate_up_proj.weight, torch.cat([gate[mlp], up[mlp]]))
            assert torch.equal(mine.o_proj.weight, full.o_proj.weight[:, q_rows])
            assert torch.equal(mine.down_proj.weight, full.down_proj.weight[:, share.mlp_rows])
            assert (mine.num_heads, mine.num_kv_heads, mine.intermediate) == (
                share.num_heads, share.num_kv_heads, share.mlp_width)
        assert torch.equal(part.lean_body.embed_tokens.weight, whole.lean_body.embed_tokens.weight)
        vocab = vocab_rows(whole.lm_head.weight.shape[0], size, rank)  # the lm_head's rows of this rank
        assert torch.equal(part.lm_head.weight, whole.lm_head.weight[vocab])


def test_engine_config_refuses_no_ranks() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig("unused", device="cpu", tensor_parallel_size=0)


def _engine_config(model_dir: Path, size: int, **overrides: object) -> EngineConfig:
    settings: dict[str, object] = {"dtype": "float32", "device": "cpu", "compile": "off",
                                   "kv_cache_bytes": 16 << 20, "max_num_batched_tokens": 32,
                                   "tensor_parallel_size": size}
    return EngineConfig(str(model_dir), **{**settings, **overrides})  # type: ignore[arg-type]


def _tokens_over_ranks(config: EngineConfig, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    with other_ranks(config) as (tp, processes):
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        try:
            return [c.output_token_ids for c in engine.generate(prompts, GREEDY)]
        finally:
            engine.stop_followers()
            for process in processes:
                process.join(timeout=30)
                assert process.exitcode == 0, "a rank did not end cleanly on Stop"


def test_two_ranks_give_one_ranks_greedy_tokens(tiny_llama_dir: Path) -> None:
    one = [c.output_token_ids for c in LLMEngine(_engine_config(tiny_llama_dir, 1)).generate(PROMPTS, GREEDY)]
    assert _tokens_over_ranks(_engine_config(tiny_llama_dir, 2), PROMPTS) == one


def test_the_vocabulary_split_over_two_ranks_gives_one_ranks_logprobs(tiny_llama_dir: Path) -> None:
    """Each rank projects onto its half of the vocabulary and rank 0 gathers the logits: the chosen tokens'
    logprobs, the top 5 and the prompt's logprobs (over a prompt longer than a prefill chunk) are one
    rank's."""
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=5, prompt_logprobs=3)
    one = LLMEngine(_engine_config(tiny_llama_dir, 1)).generate(PROMPTS[:2], sampling)
    config = _engine_config(tiny_llama_dir, 2)
    with other_ranks(config) as (tp, _):
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        try:
            assert isinstance(engine.runner.lm_head, VocabParallelHead)
            two = engine.generate(PROMPTS[:2], sampling)
        finally:
            engine.stop_followers()
    for a, b in zip(one, two, strict=True):
        assert a.output_token_ids == b.output_token_ids
        # The split sum rounds differently from the whole one: 1.0e-4 of -7.5 was seen (relative 1.4e-5).
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4, rel=3e-5)
        assert [[t for t, _ in top] for top in a.output_top_logprobs] == [
            [t for t, _ in top] for top in b.output_top_logprobs]
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        # A prompt's unlikely tokens have logprobs near -20: the split sum's rounding is relative there
        # (1.3e-4 of -22.5 was seen under the full suite's load, the base tree too).
        assert a.prompt_logprobs.logprobs == pytest.approx(b.prompt_logprobs.logprobs, abs=1e-4, rel=3e-5)
        assert a.prompt_logprobs.ranks == b.prompt_logprobs.ranks


def test_each_rank_holds_its_share_of_the_kv_heads_and_rank_0_its_staging_within_the_budget(
        tiny_llama_dir: Path) -> None:
    """Each rank keeps half the heads; rank 0's own cache and its whole-head staging cache share the KV
    memory asked for, so the same memory holds 2/3 of one rank's blocks (half + whole per block)."""
    config = _engine_config(tiny_llama_dir, 2)
    with other_ranks(config) as (tp, _):
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        try:
            assert engine.runner.kv_cache.shape[4] == 1  # the tiny Llama's 2 KV heads over 2 ranks
            assert engine.transfer_cache.shape[4] == 2  # the staging cache: every head
            used = engine.runner.kv_cache.nbytes + engine.transfer_cache.nbytes
            assert used <= 16 << 20 < used + engine.transfer_cache[0].nbytes * 3 // 2
            single = LLMEngine(_engine_config(tiny_llama_dir, 1))
            assert engine.kv_capacity.num_blocks == 2 * single.kv_capacity.num_blocks // 3
        finally:
            engine.stop_followers()


def test_without_staging_each_rank_holds_only_its_heads_and_answers_rank_0s_calls(tiny_llama_dir: Path
                                                                                  ) -> None:
    """tp_staging off (NIXL reads each rank's heads where they live): the whole budget is the ranks' own
    blocks, twice one rank's at two ranks; a call the other rank cannot answer is an error naming it, and
    the worker steps on."""
    config = replace(_engine_config(tiny_llama_dir, 2), tp_staging=False)
    with other_ranks(config) as (tp, _):
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        try:
            assert not engine.stages_kv and engine.transfer_cache is engine.runner.kv_cache
            single = LLMEngine(_engine_config(tiny_llama_dir, 1))
            assert engine.kv_capacity.num_blocks == 2 * single.kv_capacity.num_blocks
            assert engine.rank_call is not None
            with pytest.raises(RuntimeError, match="rank 1 failed str: no handler"):
                engine.rank_call("an op for the transfer layer")
            tokens = [c.output_token_ids for c in engine.generate(PROMPTS[:1], GREEDY)]
            assert tokens == [c.output_token_ids for c in single.generate(PROMPTS[:1], GREEDY)]
        finally:
            engine.stop_followers()


@pytest.mark.slow
def test_smollm2_over_two_and_three_ranks_gives_one_ranks_greedy_tokens(smollm2_dir: Path) -> None:
    """SmolLM2's 9 query and 3 KV heads split over 3 ranks evenly, over 2 as 6 + 3 and 2 + 1."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(100, 160))]
    config = _engine_config(smollm2_dir, 1, kv_cache_bytes=32 << 20)
    one = [c.output_token_ids for c in LLMEngine(config).generate(prompts, GREEDY)]
    for size in (2, 3):
        assert _tokens_over_ranks(replace(config, tensor_parallel_size=size), prompts) == one, size


def test_a_rank_that_dies_fails_rank_0s_next_step_rather_than_hanging(tiny_llama_dir: Path) -> None:
    config = _engine_config(tiny_llama_dir, 2)
    with other_ranks(config) as (tp, [rank_1]):
        engine = LLMEngine(config, tp_group=TPGroup(tp))
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))  # the group works
        assert rank_1.pid is not None
        os.kill(rank_1.pid, signal.SIGKILL)
        rank_1.join(timeout=10)
        with pytest.raises(RuntimeError):
            engine.generate([[4, 5, 6]], SamplingParams(max_tokens=2, temperature=0.0))


@pytest.mark.compile
def test_two_compiled_ranks_give_one_ranks_greedy_tokens(tiny_llama_dir: Path) -> None:
    """The all-reduce is an opaque op in each rank's graph (llm_engine/custom_ops.py), as the attention is."""
    one = [c.output_token_ids for c in LLMEngine(_engine_config(tiny_llama_dir, 1)).generate(PROMPTS, GREEDY)]
    assert _tokens_over_ranks(_engine_config(tiny_llama_dir, 2, compile="on"), PROMPTS) == one


def _tp_engine(config: EngineConfig, stack: contextlib.ExitStack, **engine_args: object) -> LLMEngine:
    """An engine of config.tensor_parallel_size ranks (the others spawned), stopped when `stack` closes."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config, **engine_args)  # type: ignore[arg-type]
    tp, _ = stack.enter_context(other_ranks(config))
    engine = LLMEngine(config, tp_group=TPGroup(tp), **engine_args)  # type: ignore[arg-type]
    stack.callback(engine.stop_followers)
    return engine


@pytest.fixture(scope="module")
def three_kv_heads_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 6 query and 3 KV heads: over 2 ranks, 4 + 2 and 2 + 1 (uneven shares)."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny-3kv"), num_attention_heads=6,
                            num_key_value_heads=3, hidden_size=192, intermediate_size=510)


@pytest.mark.parametrize(("model", "prefill_tp", "decode_tp", "kv_dtype"), [
    ("even", 2, 1, "auto"), ("even", 1, 2, "auto"), ("even", 2, 2, "auto"), ("uneven", 2, 1, "auto"),
    ("uneven", 1, 2, "auto"), ("uneven", 2, 3, "auto"), ("even", 4, 2, "auto"),
    ("uneven", 2, 1, "int8_per_token_head"), ("even", 1, 2, "int8_per_token_head")])
def test_kv_handed_between_degrees_gives_one_ranks_greedy_tokens(
        request: pytest.FixtureRequest, model: str, prefill_tp: int, decode_tp: int, kv_dtype: str) -> None:
    """A prefill worker of one degree hands its KV to a decode worker of another (the blocks leave and
    arrive whole-headed through rank 0's staging cache), and both end holding no block; with heads that
    split evenly (8 / 2 over 2 ranks), with heads that do not (6 / 3 over 2: rank 0 holds 2 KV heads,
    rank 1 one), and with more ranks than KV heads (8 / 2 over 4: each KV head on two ranks). An int8 cache's
    heads carry their scales through the gather and the scatter."""
    model_dir = request.getfixturevalue("tiny_llama_dir" if model == "even" else "three_kv_heads_dir")
    alone = LLMEngine(_engine_config(model_dir, 1, kv_cache_dtype=kv_dtype))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    one = [c.output_token_ids for c in alone.generate(PROMPTS, greedy)]
    with contextlib.ExitStack() as stack:
        prefill_engine = _tp_engine(_engine_config(model_dir, prefill_tp, kv_cache_dtype=kv_dtype), stack,
                                    scheduler_cls=PrefillScheduler)
        decode_engine = _tp_engine(_engine_config(model_dir, decode_tp, kv_cache_dtype=kv_dtype), stack,
                                   watermark=0.05)
        sender = make_sender("local", "p0", prefill_engine.transfer_cache, config=TransferConfig())
        receiver = make_receiver("local", "d0", decode_engine.transfer_cache, config=TransferConfig())
        prefill = PrefillWorker("p0", prefill_engine, sender)
        decode = DecodeWorker("d0", decode_engine, receiver)
        decode.add_peer(sender.peer_info())
        tokens = run_handoff(prefill, decode, PROMPTS)
        assert [tuple(tokens[f"r{i}"]) for i in range(len(PROMPTS))] == one
        assert prefill_engine.block_pool.is_whole() and decode_engine.block_pool.is_whole()
