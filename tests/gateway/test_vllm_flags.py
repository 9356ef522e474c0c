"""vLLM's `serve` flags as a vLLM user types them (pdserve/vllm_flags.py), parsed without a server: no-ops and
renames accepted with a log line, the rest refused with a sentence naming the flag, never argparse's
"unrecognized arguments"."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from gateway.config import ServeConfig
from pdserve.main import build_parser, main
from pdserve.serve import load_serve_config
from pdserve.vllm_flags import FLAGS, vllm_bytes


def load(*argv: str) -> ServeConfig:
    config: ServeConfig = load_serve_config(build_parser().parse_args(["serve", *argv]))
    return config


def test_the_acceptance_line_starts_with_a_log_line_per_flag(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.serve"):
        config = load("--enable-prefix-caching", "--enable-chunked-prefill", "--enable-auto-tool-choice",
                      "--dtype", "half", "--device", "cpu", "-tp", "1")
    # pdserve's CPU kernels run no float16: half becomes auto there (bfloat16 where native, else float32).
    assert config.dtype == "auto"
    said = caplog.text
    for flag in ("--enable-prefix-caching: accepted, no effect", "--enable-chunked-prefill: accepted",
                 "--enable-auto-tool-choice: accepted", "--dtype half: on a CPU"):
        assert flag in said, said


def test_renamed_flags_set_pdserves_own() -> None:
    assert load("--dtype", "half", "--device", "cuda").dtype == "float16"
    assert load("--dtype", "float").dtype == "float32"
    assert load("--kv-cache-memory-bytes", "2G").kv_cache_memory == 2 * 1024**3  # K = 1024, as vLLM
    assert load("--kv-cache-memory-bytes", "2g").kv_cache_memory == 2 * 10**9  # k = 1000
    assert load("--kv-cache-memory-bytes", "1048576").kv_cache_memory == 1 << 20
    assert load("--enforce-eager").compile == "off"
    assert load("-tp", "2").tensor_parallel_size == 2  # pdserve's own flag, in vLLM's spelling
    assert load("-tp", "2", "--decode-tp", "1").tp_degrees() == (("--tensor-parallel-size", 2),
                                                                 ("--decode-tp", 1))
    assert load("org/name", "--tokenizer", "org/name", "--load-format", "safetensors", "--max-logprobs", "20",
                "--runner", "generate", "--enable-log-requests").model == "org/name"


@pytest.mark.parametrize("argv,named", [
    (["-tp", "0"], "--tensor-parallel-size: Input should be greater than or equal to 1"),
    (["-pp", "2"], "-pp/--pipeline-parallel-size 2"),
    (["-dp", "2"], "--prefill N --decode M"),
    (["--quantization", "awq"], "-q/--quantization 'awq': pdserve serves checkpoints already quantized by "
                                "compressed-tensors"),
    (["-q", "fp8"], "`pdserve quantize` writes one"),
    (["--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat"], "merge the adapter into the model"),
    (["--enable-lora"], "--enable-lora: LoRA adapters are not served"),
    (["--no-enable-prefix-caching"], "--no-enable-prefix-caching: pdserve's prefix cache is always on"),
    (["--kv-cache-dtype", "int4"], "--kv-cache-dtype: Input should be"),
    (["--kv-transfer-config", "{}"], "--backend"),
    (["--speculative-config", "{}"], "speculative decoding"),
    (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes lots: expected a number of bytes"),
    (["--enforce-eager", "--compile", "on"], "--enforce-eager: clashes with --compile on"),
    (["--tokenizer", "other/tokenizer"], "give --chat-template"),
    (["--load-format", "gguf"], "safetensors weights only"),
    (["--max-logprobs", "50"], "--max-logprobs: Input should be less than or equal to 20"),
    (["--runner", "pooling"], "text generation only"),
    (["--task", "embed"], "text generation only"),
])
def test_what_pdserve_cannot_honour_stops_with_a_sentence_naming_the_flag(
        argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        load(*argv)
    assert named in str(raised.value)
    assert main(["serve", *argv]) == 2  # before anything starts
    assert "pdserve serve: error: " in capsys.readouterr().err


def test_an_unknown_flag_names_itself_and_where_the_flags_are(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--frobnicate", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--frobnicate: `pdserve serve` has no such flag" in err and "unrecognized arguments" not in err


def test_every_vllm_flag_is_in_the_help_and_the_docs() -> None:
    from pathlib import Path

    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for flag in FLAGS:
        assert flag.names[-1] in help_text
        assert f"`{flag.names[-1]}" in docs, flag.names


@pytest.mark.parametrize("text,expected", [("0", 0), ("1.5K", 1536), ("3m", 3_000_000), ("1T", 1 << 40)])
def test_vllm_byte_counts(text: str, expected: Any) -> None:
    assert vllm_bytes(text) == expected
