"""A lean family read and loaded from its files alone (llm_engine/checkpoint_config.py, lean_loader.py) is
what transformers reads and loads: the same shape, the same tensors in every layer, the same rotary table,
in float32 and bf16; what it cannot read the same way goes through transformers, with the reason; a worker's
engine on such a model never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_engine.checkpoint_config import LeanConfig, read_lean_config
from llm_engine.config import EngineConfig
from llm_engine.lean_loader import load_lean_model
from llm_engine.lean_model import LeanBody
from llm_engine.model_files import _spec_from_transformers, read_model_spec
from llm_engine.model_loader import _load_transformers_model
from llm_engine.tiny_model import build_tiny_model

LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def rewrite_config(model_dir: Path, **fields: Any) -> None:
    """Set (a value) or drop (None with drop=...) fields of the directory's config.json."""
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    for name, value in fields.items():
        if value is ...:
            raw.pop(name, None)
        else:
            raw[name] = value
    path.write_text(json.dumps(raw))


def spec_both_ways(model_dir: Path) -> tuple[Any, Any]:
    spec = read_model_spec(model_dir)
    return spec, _spec_from_transformers(model_dir, spec.architecture, spec.eos_token_ids)


def same_tensor(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                         and torch.equal(a, b))


def assert_same_bodies(ours: LeanBody, theirs: LeanBody) -> None:
    assert same_tensor(ours.cos, theirs.cos) and same_tensor(ours.sin, theirs.sin)
    assert same_tensor(ours.embed_tokens.weight, theirs.embed_tokens.weight)  # type: ignore[arg-type]
    assert same_tensor(ours.norm, theirs.norm) and ours.eps == theirs.eps
    assert len(ours.layers) == len(theirs.layers)
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            assert same_tensor(getattr(a, name).weight, getattr(b, name).weight), name
            assert same_tensor(getattr(a, name).bias, getattr(b, name).bias), name
        for name in ("input_norm", "post_attention_norm", "q_norm", "k_norm"):
            assert same_tensor(getattr(a, name), getattr(b, name)), name
        shape = ("num_heads", "num_kv_heads", "head_dim", "scaling", "eps", "qk_eps", "intermediate")
        assert [getattr(a, n) for n in shape] == [getattr(b, n) for n in shape]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_a_lean_family_loads_from_its_files_as_transformers_loads_it(family: str, dtype: str,
                                                                     tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    assert isinstance(read_lean_config(model_dir), LeanConfig)
    spec, reference_spec = spec_both_ways(model_dir)
    assert spec == reference_spec
    config = EngineConfig(model_dir=str(model_dir), dtype=dtype)
    lean = read_lean_config(model_dir)
    assert isinstance(lean, LeanConfig)
    ours = load_lean_model(lean, model_dir, config.torch_dtype, torch.device("cpu"), spec.max_model_len)
    hf_model = _load_transformers_model(config, torch.device("cpu"))
    lm_head = hf_model.lm_head.weight
    theirs = LeanBody.from_hf(hf_model, spec.max_model_len)
    assert_same_bodies(ours.lean_body, theirs)
    assert same_tensor(ours.lm_head.weight, lm_head)


def test_the_default_model_reads_the_same_and_ties_its_head(smollm2_dir: Path) -> None:
    lean = read_lean_config(smollm2_dir)
    assert isinstance(lean, LeanConfig) and lean.tie_word_embeddings
    spec, reference_spec = spec_both_ways(smollm2_dir)
    assert spec == reference_spec
    model = load_lean_model(lean, smollm2_dir, torch.float32, torch.device("cpu"), 64)
    assert model.lm_head.weight.data_ptr() == model.lean_body.embed_tokens.weight.data_ptr()


def test_the_layout_before_transformers_5_reads_the_same(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path / "m")
    rewrite_config(model_dir, rope_parameters=..., rope_theta=50000.0, rope_scaling=None)
    lean = read_lean_config(model_dir)
    assert isinstance(lean, LeanConfig) and lean.rope_theta == 50000.0
    assert spec_both_ways(model_dir)[0] == spec_both_ways(model_dir)[1]
    config = EngineConfig(model_dir=str(model_dir), dtype="float32")
    hf = _load_transformers_model(config, torch.device("cpu"))
    ours = load_lean_model(lean, model_dir, torch.float32, torch.device("cpu"), 128)
    assert_same_bodies(ours.lean_body, LeanBody.from_hf(hf, 128))


@pytest.mark.parametrize(("family", "fields", "reason"), [
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "rope type"),
    ("llama", {"rope_parameters": ..., "rope_theta": 1e4, "rope_scaling": {"rope_type": "yarn"}}, "rope"),
    ("llama", {"attention_bias": True}, "biases"),
    ("llama", {"hidden_act": "gelu"}, "activation"),
    ("llama", {"num_key_value_heads": ...}, "num_key_value_heads"),
    ("mistral", {"sliding_window": ...}, "sliding_window"),
    ("qwen3", {"head_dim": ...}, "head_dim"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window"),
    ("gemma", {}, "no lean body"),
])
def test_what_only_transformers_reads_right_goes_through_it_with_the_reason(
        family: str, fields: dict[str, Any], reason: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    rewrite_config(model_dir, **fields)
    read = read_lean_config(model_dir)
    assert isinstance(read, str) and reason in read


def test_weights_only_in_another_format_go_through_transformers(tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path / "m")
    (model_dir / "model.safetensors").rename(model_dir / "elsewhere.safetensors")
    assert read_lean_config(model_dir) == "no safetensors weights"


def test_a_worker_engine_on_a_lean_model_never_imports_transformers(tiny_llama_dir: Path) -> None:
    code = ("import sys; from llm_engine.engine import LLMEngine; "
            "from llm_engine.config import EngineConfig; "
            f"engine = LLMEngine(EngineConfig(model_dir={str(tiny_llama_dir)!r}, dtype='float32')); "
            "from llm_engine.sampling import SamplingParams; "
            "engine.add_request([1, 2, 3], SamplingParams(max_tokens=2)); [engine.step() for _ in range(3)]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
