"""An 8-bit KV cache (--kv-cache-dtype fp8, llm_engine/kv_dtype.py): twice the tokens in the memory of a
bfloat16 one, outputs held to vLLM's standard against transformers, handed from prefill to decode as its
bytes (half a bfloat16 handoff's), and a peer whose cache is of another dtype refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kv_transfer import IncompatibleLayoutError
from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.model_runner import choose_decode_attention
from llm_engine.tiny_model import build_tiny_model
from tests.helpers.engines import make_pair, run_handoff
from tests.helpers.reference import assert_close_as_vllm_does, random_prompts


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("kv8") / "llama")


@pytest.mark.parametrize("name", ["fp8", "fp8_e5m2"])
def test_an_eight_bit_cache_holds_twice_the_tokens(name: str, tiny_llama: Path) -> None:
    budget = 4 << 20
    bf16 = LLMEngine(EngineConfig(str(tiny_llama), dtype="bfloat16", kv_cache_bytes=budget, compile="off"))
    eight = LLMEngine(EngineConfig(str(tiny_llama), dtype="bfloat16", kv_cache_bytes=budget, compile="off",
                                   kv_cache_dtype=name))
    assert eight.runner.kv_cache.element_size() == 1
    assert eight.kv_capacity.num_tokens == 2 * bf16.kv_capacity.num_tokens
    assert eight.runner.decode_attention == "sdpa"  # the C++ kernel reads bfloat16 and float32 caches
    prompts = random_prompts([7, 30, 12, 45], 1000, seed=3)
    completions = eight.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert all(len(c.output_token_ids) == 12 for c in completions)
    assert eight.block_pool.is_whole()


@pytest.mark.slow
def test_an_eight_bit_cache_keeps_vllms_standard_on_the_default_model() -> None:
    """Against the same engine with a bfloat16 cache, on chat prompts (a random tiny model's near-ties flip
    under e4m3's 3-bit mantissa within a token or two; the real model's do not)."""
    from transformers import AutoTokenizer

    from llm_engine.default_model import prepare_default_model

    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = ["What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?",
                 "How do airplanes fly?", "What is machine learning?", "Tell me a fun fact about the moon."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for q in questions]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=5)
    runs = {}
    for name in ("auto", "fp8"):
        engine = LLMEngine(EngineConfig(str(model_dir), dtype="bfloat16", kv_cache_bytes=64 << 20,
                                        compile="off", decode_attention="sdpa", kv_cache_dtype=name))
        runs[name] = [engine.generate([prompt], params)[0] for prompt in prompts]
    for ours, theirs in zip(runs["fp8"], runs["auto"], strict=True):
        our_top = [{t for t, _ in step} for step in ours.output_top_logprobs]
        their_top = [{t for t, _ in step} for step in theirs.output_top_logprobs]
        assert_close_as_vllm_does(list(ours.output_token_ids), our_top, list(theirs.output_token_ids),
                                  their_top)


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_an_eight_bit_cache_is_handed_off_as_its_bytes(backend: str, tiny_llama: Path) -> None:
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    settings: dict[str, object] = {"kv_cache_dtype": "fp8"}
    prompts = random_prompts([20, 45, 5], 1000, seed=11)
    alone = LLMEngine(EngineConfig(str(tiny_llama), dtype="float32", kv_cache_bytes=8 << 20, **settings))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [list(c.output_token_ids) for c in alone.generate(prompts, greedy)]
    prefill, decode = make_pair(tiny_llama, backend=backend, prefill_settings=settings,
                                decode_settings=settings)
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def test_a_decode_worker_with_another_kv_dtype_is_refused_naming_it(tiny_llama: Path) -> None:
    refused = "dtype: source 'float32' != destination 'float8_e4m3fn'"
    with pytest.raises(IncompatibleLayoutError, match=refused):
        make_pair(tiny_llama, decode_settings={"kv_cache_dtype": "fp8"})  # refused as the decode side peers


def test_the_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig("unused", kv_cache_dtype="int8_per_token_head")
    with pytest.raises(RuntimeError, match="paged-kernel' reads float32 and bfloat16 caches"):
        choose_decode_attention(EngineConfig("unused", device="cpu", kv_cache_dtype="fp8",
                                             decode_attention="paged-kernel"))


def test_serve_refuses_an_eight_bit_cache_over_ranks_staged_through_rank_zero(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.main import main

    argv = ["serve", "-tp", "2", "--backend", "torch", "--kv-cache-dtype", "fp8", "--device", "cpu"]
    assert main(argv) == 2
    assert "--kv-cache-dtype fp8 with tensor-parallel workers needs --backend nixl" in capsys.readouterr().err
