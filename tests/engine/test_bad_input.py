"""Bad input gets a clear exception naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.model_files import read_model_spec


def test_unknown_model_dir(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(str(tmp_path / "nope"), dtype="float32"))
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        read_model_spec(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        read_model_spec(tmp_path)


def test_invalid_engine_config() -> None:
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig("x", dtype="float64")
    with pytest.raises(ValueError, match="float16 runs on CUDA only"):
        EngineConfig("x", dtype="float16")
    with pytest.raises(ValueError, match="linear_kernel must be one of auto, torch, onednn-packed"):
        EngineConfig("x", linear_kernel="mkl")
    with pytest.raises(ValueError, match="device must be"):
        EngineConfig("x", device="tpu")


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=4 << 20))


def test_prompt_longer_than_context(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="exceeds the maximum context length of 1024 tokens"):
        engine.add_request([1] * 1020, SamplingParams(max_tokens=10))


def test_empty_prompt_and_out_of_vocab_tokens(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="out of the vocabulary"):
        engine.add_request([5, 1000], SamplingParams())


def test_request_larger_than_the_kv_budget(tiny_llama_dir: Path, engine: LLMEngine) -> None:
    four_blocks = 4 * engine.runner.cache_spec.block_bytes
    small = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=four_blocks))
    with pytest.raises(ValueError, match="more KV blocks than this worker has"):
        small.add_request([1] * 100, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="holds no block"):
        LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=100))


def test_duplicate_request_id(engine: LLMEngine) -> None:
    engine.add_request([1, 2], SamplingParams(), request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], SamplingParams(), request_id="same")
    engine.abort("same")
