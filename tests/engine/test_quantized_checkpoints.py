"""Quantized checkpoints (llm_engine/weight_schemes.py, quantized_linear.py, checkpoint_quantizer.py): what
`pdserve quantize` writes, transformers loads (through compressed-tensors) and the engine serves, held to
vLLM's standard against transformers running the same checkpoint; the handoff of such a model; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.checkpoint_quantizer import quantize_checkpoint
from llm_engine.model_files import read_model_spec
from llm_engine.quantized_linear import (
    DequantizedLinear,
    Int8Linear,
    QuantizedWeight,
    WeightOnlyLinear,
    unpack_int32,
)
from llm_engine.tiny_model import build_tiny_model
from llm_engine.weight_schemes import LayerQuant, UnsupportedQuantization, check_quantization_flag
from pdserve.main import main
from tests.helpers.engines import make_pair, run_handoff
from tests.helpers.reference import assert_engine_close_to_transformers, random_prompts

SCHEMES = {"W8A8": "w8a8", "W8A16": "w8a16", "W4A16": "w4a16-g128", "W4A16_ASYM": "w4a16-g128-asym"}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("quant") / "llama")


@pytest.fixture(scope="module")
def quantized(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama in each scheme, written by `pdserve quantize`'s function."""
    root = tmp_path_factory.mktemp("quantized")
    return {scheme: quantize_checkpoint(tiny_llama, root / scheme, scheme) for scheme in SCHEMES}


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_undoes_compressed_tensors_packing(bits: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    values = torch.randint(low, high, (48, 202), dtype=torch.int8)  # 202 columns: a partial last word
    assert torch.equal(unpack_int32(pack_to_int32(values, bits), 202, bits), values)
    zero = torch.randint(low, high, (48, 5), dtype=torch.int8)  # zero points: packed along the rows
    packed = pack_to_int32(zero, bits, packed_dim=0)
    assert torch.equal(unpack_int32(packed.t().contiguous(), 48, bits).t(), zero)


def _decompressed(model_dir: Path, out: Path) -> Path:
    """The checkpoint's weights as compressed-tensors itself decompresses them, saved unquantized: the
    reference
    for W4A16_ASYM, whose packed zero points transformers 5.25 refuses to load (it sizes that parameter
    unpacked)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    scheme = QuantizationConfig.model_validate(config.pop("quantization_config")).config_groups["group_0"]
    tensors = load_file(str(model_dir / "model.safetensors"))
    for prefix in {name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight_packed")}:
        local = {key.removeprefix(prefix + "."): tensors.pop(key) for key in list(tensors)
                 if key.startswith(prefix + ".weight_")}
        tensors[f"{prefix}.weight"] = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_the_engine_serves_each_scheme_as_transformers_runs_the_same_checkpoint(
        scheme: str, quantized: dict[str, Path], tmp_path: Path) -> None:
    model_dir = quantized[scheme]
    reference = _decompressed(model_dir, tmp_path / "reference") if scheme == "W4A16_ASYM" else model_dir
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    spec = read_model_spec(model_dir)
    assert spec.weights == SCHEMES[scheme]
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20))
    kernels = {type(m) for m in engine.runner.model.modules()}
    assert (Int8Linear if scheme == "W8A8" else WeightOnlyLinear) in kernels
    assert_engine_close_to_transformers(engine, reference, random_prompts([9, 40, 17], 1000, seed=5), 12)
    assert engine.block_pool.is_whole()


@pytest.mark.compile
def test_the_compiled_body_serves_int8_weights_to_the_standard(quantized: dict[str, Path]) -> None:
    """W8A8: the activations' rounding traced around the pdserve::int8_gemm op (the weight-only layers sit
    whole behind pdserve::packed_linear, whose compiled path test_compiled_engine covers). Held to the
    standard, not to the eager body's tokens: inductor divides by a token's scale as a multiply by its
    reciprocal, which rounds an activation lying on a half step to the other int8 value."""
    model_dir = quantized["W8A8"]
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20, compile="on"))
    assert engine.compilation.compiled
    assert_engine_close_to_transformers(engine, model_dir, random_prompts([9, 40, 17], 1000, seed=5), 12)


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_bfloat16_activations_over_integer_weights_keep_the_standard(scheme: str,
                                                                    quantized: dict[str, Path]) -> None:
    """Against the checkpoint run in float32: transformers' own bfloat16 run of it rounds the activations'
    int8 scales in bfloat16 (ours in float32), and on this random model (logits of tens, near-ties) either
    bfloat16 run drifts from the other within a few tokens."""
    model_dir = quantized[scheme]
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="bfloat16", kv_cache_bytes=8 << 20, compile="off"))
    assert_engine_close_to_transformers(engine, model_dir, random_prompts([7, 30, 12], 1000, seed=3), 12)


@pytest.mark.parametrize("scheme", ["W8A8", "W4A16"])
def test_a_quantized_model_hands_its_kv_from_prefill_to_decode(scheme: str,
                                                               quantized: dict[str, Path]) -> None:
    model_dir = quantized[scheme]
    prompts = random_prompts([20, 45, 5], 1000, seed=11)
    alone = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20))
    expected = [list(c.output_token_ids) for c in alone.generate(prompts, SamplingParams(max_tokens=12,
                                                                                        temperature=0.0))]
    prefill, decode = make_pair(model_dir)
    tokens = run_handoff(prefill, decode, prompts)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def test_each_kernel_computes_what_the_checkpoint_dequantizes_to() -> None:
    quant = LayerQuant(4, 32, True, False)
    values = torch.randint(-8, 8, (24, 64), dtype=torch.int8)  # 24 rows: not a multiple of 16
    weight = QuantizedWeight(quant, values, torch.rand(24, 2) + 0.1, None, None, torch.float32)
    layer = weight.linear()
    assert isinstance(layer, DequantizedLinear)
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), x @ weight.dequantized().t())
    for bits, zero in ((4, torch.randint(-8, 8, (32, 2), dtype=torch.int8)), (8, None)):
        values = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (32, 64), dtype=torch.int8)
        weight = QuantizedWeight(LayerQuant(bits, 32 if bits == 4 else None, zero is None, False), values,
                                 torch.rand(32, 2 if bits == 4 else 1) + 0.1, zero, None, torch.float32)
        layer = weight.linear()
        assert isinstance(layer, WeightOnlyLinear)
        for rows in (3, 40):  # the packed kernel; the weight dequantized for a prefill's rows
            x = torch.randn(rows, 64)
            assert torch.allclose(layer(x), x @ weight.dequantized().t(), atol=1e-3), (bits, rows)


def _config_with(model_dir: Path, out: Path, quantization: dict[str, object]) -> Path:
    out.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    return out


@pytest.mark.parametrize(("quantization", "named"), [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method 'gptq', 4-bit"),
    ({"quant_method": "awq", "w_bit": 4}, "quant_method 'awq'"),
    ({"quant_method": "fp8"}, "quant_method 'fp8'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "format 'float-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     "8-bit int activations by tensor, static"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized", "kv_cache_scheme": {"num_bits": 8},
      "config_groups": {}}, "a quantized KV cache"),
])
def test_an_unsupported_checkpoint_is_refused_naming_its_scheme_and_the_supported_ones(
        quantization: dict[str, object], named: str, tiny_llama: Path, tmp_path: Path) -> None:
    model_dir = _config_with(tiny_llama, tmp_path / "q", quantization)
    with pytest.raises(UnsupportedQuantization, match="not supported") as refused:
        read_model_spec(model_dir)
    assert named in str(refused.value) and "W8A8" in str(refused.value) and "W4A16" in str(refused.value)


def test_serve_stops_at_start_on_an_unsupported_checkpoint(tiny_llama: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = _config_with(tiny_llama, tmp_path / "gptq", {"quant_method": "gptq", "bits": 4})
    assert main(["serve", "--model", str(model_dir)]) == 2  # before any worker, any Ray
    err = capsys.readouterr().err
    assert f"--model {model_dir}: the checkpoint's quantization (quant_method 'gptq', 4-bit)" in err
    assert "W4A16" in err


def test_quantized_weights_that_only_transformers_would_read_are_refused(quantized: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    out = tmp_path / "scaled"
    out.mkdir()
    config = json.loads((quantized["W8A8"] / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config.pop("rope_parameters", None)
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").symlink_to(quantized["W8A8"] / "model.safetensors")
    with pytest.raises(UnsupportedQuantization, match="engine's own body"):
        read_model_spec(out)


def test_the_quantization_flag_is_checked_against_the_checkpoint() -> None:
    check_quantization_flag(None, None)
    with pytest.raises(UnsupportedQuantization, match=r"-q/--quantization 'awq'.*compressed-tensors"):
        check_quantization_flag("awq", None)
    with pytest.raises(UnsupportedQuantization, match="not quantized"):
        check_quantization_flag("compressed-tensors", None)


def test_pdserve_quantize_refuses_a_group_size_the_kernels_do_not_take(
        tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["quantize", "--model", str(tiny_llama), "--out", str(tmp_path / "q"), "--scheme", "w4a16",
                   "--group-size", "96"])
    assert status == 2
    assert "--group-size 96" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    assert main(["quantize", "--model", str(tiny_llama), "--out", str(tmp_path / "q8")]) == 0
    assert read_model_spec(tmp_path / "q8").weights == "w8a8"
    assert main(["quantize", "--model", str(tmp_path / "q8"), "--out", str(tmp_path / "again")]) == 2
    assert "quantized already" in capsys.readouterr().err
