"""`pdserve serve` settings: the example YAML loads, bad values name the flag, flags override the file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from gateway.config import ServeConfig
from gateway.serve_settings import deployment_config
from worker_runtime.roles import Role

EXAMPLE = Path(__file__).parents[2] / "deploy" / "serve.example.yaml"


def test_example_config_loads_and_flags_override() -> None:
    config = ServeConfig.from_yaml(EXAMPLE, prefill=2, port=None)
    assert (config.prefill, config.decode, config.port, config.is_loopback) == (2, 1, 8000, True)


def test_unknown_and_invalid_settings_are_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefil: 2\n")
    with pytest.raises(ValidationError, match="prefil"):
        ServeConfig.from_yaml(bad)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ServeConfig(decode=-1)
    with pytest.raises(ValidationError, match="cannot serve"):
        ServeConfig(decode=0)
    with pytest.raises(ValidationError, match="torch backend"):
        ServeConfig(ratio="auto", backend="torch")


def test_roles_not_named_are_zero_unless_none_is() -> None:
    default = ServeConfig()
    assert (default.prefill, default.decode, default.mixed) == (1, 1, None)
    assert deployment_config(ServeConfig(mixed=2), "m").layout() == {Role.PREFILL: 0, Role.DECODE: 0,
                                                                    Role.MIXED: 2}
    assert deployment_config(ServeConfig(prefill=1, mixed=1), "m").layout() == {
        Role.PREFILL: 1, Role.DECODE: 0, Role.MIXED: 1}


def test_cli_names_the_bad_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--decode", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "--decode" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", "/no/such/dir"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--model" in missing.stderr and "does not exist" in missing.stderr


@pytest.mark.parametrize(("flags", "needle"), [
    (["--threads-per-worker", "0"], "--threads-per-worker: Input should be greater than or equal to 1"),
    (["--dtype", "float16"], "--dtype float16: dtype float16 runs on CUDA only"),
    (["--dtype", "float64"], "--dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'"),
    (["--linear-kernel", "mkl"],
     "--linear-kernel: Input should be 'auto', 'torch', 'onednn-packed' or 'zentorch'"),
    (["--decode-attention", "flash"], "--decode-attention: Input should be 'auto', 'sdpa' or 'paged-kernel'"),
    (["--kv-cache-memory", "2XB"], "--kv-cache-memory: '2XB': give bytes with a unit"),
    (["--kv-cache-memory", "1.5"], "--kv-cache-memory: 1.5: give bytes with a unit"),
    (["--gpu-memory-utilization", "0.5"], "--gpu-memory-utilization sizes a GPU's memory (--device cuda)"),
    (["--gpu-memory-utilization", "1.5", "--device", "cuda"],
     "--gpu-memory-utilization: Input should be less"),
    (["--max-num-seqs", "0"], "--max-num-seqs: Input should be greater than or equal to 1"),
    (["--device", "tpu"], "--device: device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    pytest.param(["--device", "cuda"], "--device cuda: no CUDA GPU is visible to this process",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")),
    (["--compile", "always"], "--compile: Input should be 'auto', 'on' or 'off'"),
])
def test_cli_refuses_bad_engine_settings_naming_the_flag(flags: list[str], needle: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # The command's main() in this process (a Python start and its imports per case cost seconds); the exit
    # status of the process itself is test_cli_names_the_bad_flag's.
    from pdserve.main import main

    capsys.readouterr()
    try:
        returncode = main(["serve", *flags])
    except SystemExit as exit_:  # argparse's own refusals exit
        returncode = exit_.code  # type: ignore[assignment]
    assert returncode == 2
    assert needle in capsys.readouterr().err


def test_threads_default_to_the_cores_split_over_the_workers() -> None:
    cores = len(os.sched_getaffinity(0))
    assert deployment_config(ServeConfig(), "m").num_threads == max(1, cores // 2)  # 1 prefill + 1 decode
    assert deployment_config(ServeConfig(mixed=1), "m").num_threads == cores
    assert deployment_config(ServeConfig(threads_per_worker=3), "m").num_threads == 3
    assert deployment_config(ServeConfig(ray_address="auto", cpus_per_worker=4), "m").num_threads == 4
    assert deployment_config(ServeConfig(pin_cpus=False), "m").pin_cpus is False


def test_metrics_require_key_is_a_switch_off_by_default() -> None:
    from pdserve.main import build_parser

    assert build_parser().parse_args(["serve", "--metrics-require-key"]).metrics_require_key is True
    assert build_parser().parse_args(["serve"]).metrics_require_key is None  # the field's default: off
    assert ServeConfig().metrics_require_key is False


def test_sizing_settings_reach_the_engine() -> None:
    engine = deployment_config(ServeConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128,
                         kv_cache_memory="3GiB", kv_cache_mib=5), "m").engine
    assert (engine.max_model_len, engine.max_num_seqs, engine.max_num_batched_tokens) == (256, 8, 128)
    assert (engine.kv_cache_bytes, engine.kv_cache_fraction) == (3 << 30, None)  # --kv-cache-memory wins
    assert deployment_config(ServeConfig(kv_cache_mib=5), "m").engine.kv_cache_bytes == 5 << 20
    fraction = deployment_config(ServeConfig(kv_cache_memory="0.2"), "m").engine
    assert (fraction.kv_cache_bytes, fraction.kv_cache_fraction) == (None, 0.2)
    cuda = deployment_config(ServeConfig(device="cuda", gpu_memory_utilization=0.5), "m").engine
    assert cuda.gpu_memory_utilization == 0.5
    default = deployment_config(ServeConfig(), "m").engine
    assert (default.kv_cache_bytes, default.kv_cache_fraction, default.max_model_len) == (None, None, None)


def test_cli_refuses_a_max_model_len_beyond_the_model(tiny_llama_dir: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", str(tiny_llama_dir),
                             "--max-model-len", "4096"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "--max-model-len 4096 exceeds the model's context of 1024 tokens" in result.stderr


def test_a_named_fleet_needs_a_cluster_that_outlives_the_gateway() -> None:
    with pytest.raises(ValueError, match=r"--fleet-name .* give --address"):
        ServeConfig(fleet_name="main")
    with pytest.raises(ValueError, match="fleet_name"):
        ServeConfig(fleet_name="no spaces", ray_address="auto")
    assert ServeConfig(fleet_name="main", ray_address="auto").fleet_name == "main"


@pytest.mark.parametrize("key", ["", "   ", "\n"])
def test_an_empty_api_key_is_refused_not_taken_for_none(key: str) -> None:
    # An empty PDSERVE_API_KEY (a Secret with no value) used to turn the key check off.
    with pytest.raises(ValidationError, match="api-key is empty"):
        ServeConfig(api_key=key)
