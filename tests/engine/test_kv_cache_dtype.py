"""An 8-bit KV cache (--kv-cache-dtype fp8, llm_engine/kv_dtype.py): twice the tokens in the memory of a
bfloat16 one, outputs held to vLLM's standard against transformers, handed from prefill to decode as its
bytes (half a bfloat16 handoff's) or converted on arrival where the two sides keep other types, and a peer
whose blocks cannot convert refused by name."""

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


@pytest.mark.parametrize(("name", "ratio"), [("fp8", 2.0), ("fp8_e5m2", 2.0),
                                           ("int8_per_token_head", 2 * 32 / 36)])
def test_an_eight_bit_cache_holds_twice_the_tokens(name: str, ratio: float, tiny_llama: Path) -> None:
    """The tiny Llama's heads are 32 wide: an int8 head takes 32 values and its 4-byte scale (SmolLM2's 64:
    1.88×)."""
    budget = 4 << 20
    bf16 = LLMEngine(EngineConfig(str(tiny_llama), dtype="bfloat16", kv_cache_bytes=budget, compile="off"))
    eight = LLMEngine(EngineConfig(str(tiny_llama), dtype="bfloat16", kv_cache_bytes=budget, compile="off",
                                   kv_cache_dtype=name))
    assert eight.runner.kv_cache.element_size() == 1
    assert eight.kv_capacity.num_tokens == pytest.approx(ratio * bf16.kv_capacity.num_tokens, rel=0.02)
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
    for name in ("auto", "fp8", "int8_per_token_head"):
        engine = LLMEngine(EngineConfig(str(model_dir), dtype="bfloat16", kv_cache_bytes=64 << 20,
                                        compile="off", decode_attention="sdpa", kv_cache_dtype=name))
        runs[name] = [engine.generate([prompt], params)[0] for prompt in prompts]
    for name in ("fp8", "int8_per_token_head"):
        for ours, theirs in zip(runs[name], runs["auto"], strict=True):
            our_top = [{t for t, _ in step} for step in ours.output_top_logprobs]
            their_top = [{t for t, _ in step} for step in theirs.output_top_logprobs]
            assert_close_as_vllm_does(list(ours.output_token_ids), our_top, list(theirs.output_token_ids),
                                      their_top)


@pytest.mark.parametrize("name", ["fp8", "int8_per_token_head"])
@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_an_eight_bit_cache_is_handed_off_as_its_bytes(backend: str, name: str, tiny_llama: Path) -> None:
    """The int8 cache's scales travel inside its blocks: the decode worker reads the prefill worker's."""
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    settings: dict[str, object] = {"kv_cache_dtype": name}
    prompts = random_prompts([20, 45, 5], 1000, seed=11)
    alone = LLMEngine(EngineConfig(str(tiny_llama), dtype="float32", kv_cache_bytes=8 << 20, **settings))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [list(c.output_token_ids) for c in alone.generate(prompts, greedy)]
    prefill, decode = make_pair(tiny_llama, backend=backend, prefill_settings=settings,
                                decode_settings=settings)
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_a_handoff_into_an_eight_bit_decode_worker_converts(backend: str, tiny_llama: Path) -> None:
    """Prefill keeps the model's dtype, decode fp8 (--decode-kv-cache-dtype fp8): the decode worker holds
    the prompt's KV as its own forward would have stored it, so its tokens are those of one fp8 engine that
    did it all (a one-chunk prompt attends to its fresh keys, not the cache's); and back, fp8 into float32,
    the first token (the prefill side's) is that engine's and every block comes home."""
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    eight_bit: dict[str, object] = {"kv_cache_dtype": "fp8"}
    prompts = random_prompts([20, 45, 5], 1000, seed=11)
    alone = LLMEngine(EngineConfig(str(tiny_llama), dtype="float32", kv_cache_bytes=8 << 20, **eight_bit))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [list(c.output_token_ids) for c in alone.generate(prompts, greedy)]

    prefill, decode = make_pair(tiny_llama, backend=backend, decode_settings=eight_bit)
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()

    prefill, decode = make_pair(tiny_llama, backend=backend, prefill_settings=eight_bit)
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"][0] for i in range(len(prompts))] == [e[0] for e in expected]
    assert all(len(tokens[f"r{i}"]) == 12 for i in range(len(prompts)))
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def test_a_decode_worker_whose_cache_cannot_take_the_blocks_is_refused_naming_it(tiny_llama: Path) -> None:
    refused = "block_size: source 16 != destination 32"
    with pytest.raises(IncompatibleLayoutError, match=refused):
        make_pair(tiny_llama, decode_settings={"kv_cache_dtype": "fp8", "block_size": 32})


def test_the_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="must be one of auto, fp8, fp8_e4m3, fp8_e5m2, int8_per_token_h"):
        EngineConfig("unused", kv_cache_dtype="int4_per_token_head")
    with pytest.raises(RuntimeError, match="paged-kernel' reads float32 and bfloat16 caches"):
        choose_decode_attention(EngineConfig("unused", device="cpu", kv_cache_dtype="fp8",
                                             decode_attention="paged-kernel"))


def test_serve_refuses_an_eight_bit_cache_over_ranks_staged_through_rank_zero(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.main import main

    argv = ["serve", "-tp", "2", "--backend", "torch", "--kv-cache-dtype", "fp8", "--device", "cpu"]
    assert main(argv) == 2
    assert "--kv-cache-dtype fp8 with tensor-parallel workers needs --backend nixl" in capsys.readouterr().err


def test_each_role_keeps_its_own_kv_cache_type_and_no_worker_changes_role_across_two(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.config import ServeConfig
    from gateway.ratio.resize import plan_moves
    from gateway.serve_settings import deployment_config
    from pdserve.main import main
    from worker_runtime.roles import Role

    config = deployment_config(ServeConfig(prefill=2, decode=1, decode_kv_cache_dtype="fp8"), "m")
    kinds = {role: config.engine_for(role).kv_cache_dtype for role in Role}
    assert kinds == {Role.PREFILL: "auto", Role.DECODE: "fp8", Role.MIXED: "fp8"}
    same = deployment_config(ServeConfig(kv_cache_dtype="fp8", prefill_kv_cache_dtype="fp8"), "m")
    assert same.engine_for(Role.PREFILL) == same.engine_for(Role.DECODE)
    # 2P+1D → 1P+2D: a prefill worker cannot become a decode worker in place (its cache is bfloat16): one is
    # added and one drained, where one engine for both would have moved one.
    moves = plan_moves(config.layout(), {Role.PREFILL: 1, Role.DECODE: 2, Role.MIXED: 0},
                       lambda a, b: config.engine_for(a) == config.engine_for(b))
    assert sorted(m.action for m in moves) == ["add", "drain"]

    argv = ["serve", "--mixed", "2", "--ratio", "auto", "--decode-kv-cache-dtype", "fp8", "--device", "cpu"]
    assert main(argv) == 2
    assert "--ratio auto moves workers between roles, and a worker's KV cache" in capsys.readouterr().err


def test_the_wire_dtype_reaches_every_sender_and_is_refused_over_nixl_ranks(
        capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.config import ServeConfig
    from gateway.serve_settings import deployment_config
    from pdserve.main import main

    assert deployment_config(ServeConfig(kv_transfer_dtype="fp8"), "m").transfer.wire_dtype == "float8_e4m3fn"
    assert deployment_config(ServeConfig(kv_transfer_dtype="auto"), "m").transfer.wire_dtype == ""
    argv = ["serve", "-tp", "2", "--backend", "nixl", "--kv-transfer-dtype", "fp8", "--device", "cpu"]
    assert main(argv) == 2
    assert "--kv-transfer-dtype fp8 with tensor-parallel workers over nixl" in capsys.readouterr().err
    argv = ["serve", "--kv-cache-dtype", "int8_per_token_head", "--prefill-kv-cache-dtype", "auto",
            "--device", "cpu"]
    assert main(argv) == 2
    assert "int8_per_token_head: its blocks carry their scales" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["local", "nixl"])
def test_a_wire_dtype_moves_eight_bit_blocks_between_two_full_width_caches(backend: str,
                                                                          tiny_llama: Path) -> None:
    """--kv-transfer-dtype fp8 between two float32 caches: a quarter of the bytes cross, every block comes
    home, the first token (the prefill side's) is the plain engine's and every stream runs to its length (a
    random tiny model's later tokens may flip under fp8's rounding: the real model's standard is measured in
    benchmarks/kv_dtype_handoff.py)."""
    if backend == "nixl":
        pytest.importorskip("nixl._bindings")
    from kv_transfer import TransferConfig

    prompts = random_prompts([20, 45, 5], 1000, seed=11)
    alone = LLMEngine(EngineConfig(str(tiny_llama), dtype="float32", kv_cache_bytes=8 << 20))
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [list(c.output_token_ids) for c in alone.generate(prompts, greedy)]
    prefill, decode = make_pair(tiny_llama, backend=backend,
                                transfer_config=TransferConfig(wire_dtype="float8_e4m3fn"))
    assert prefill.sender.layout.dtype == "float8_e4m3fn"
    assert decode.engine.runner.kv_cache.dtype.itemsize == 4
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"][0] for i in range(len(prompts))] == [e[0] for e in expected]
    assert all(len(tokens[f"r{i}"]) == 12 for i in range(len(prompts)))
    (record, *_) = decode.receiver.recorder.records
    assert record.num_bytes == record.num_blocks * prefill.engine.kv_block_bytes // 4
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()
