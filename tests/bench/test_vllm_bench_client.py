"""vLLM's own `vllm bench serve` client against pdserve, without --model (benchmarks/vllm_bench_client.py),
and beside `pdserve bench` with the same flags against one recording server: the same request bodies, and
vLLM's result keys. Runs only where a Python with vLLM's benchmark client exists (not a dependency of
pdserve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_bench_client import CLIENT, DEFAULT_VENV, PREBUILT_VENV, has_client
from pdserve.main import main
from tests.helpers.recording_server import MODEL, Recorder, recording_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
CLIENT_PYTHONS = [v / "bin" / "python" for v in (DEFAULT_VENV, PREBUILT_VENV)]
needs_client = pytest.mark.skipif(
    not any(has_client(python) for python in CLIENT_PYTHONS),
    reason=f"no vLLM benchmark client in {DEFAULT_VENV} or {PREBUILT_VENV} (the script can install one: "
           "minutes and GBs)")


@needs_client
def test_vllm_bench_serve_runs_against_pdserve(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_bench_client.py"), "--model",
                             str(tiny_chat_model_dir), "--out", str(tmp_path), "--num-prompts", "4",
                             "--input-len", "16", "--output-len", "4"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0 and saved["total_output_tokens"] == 16


@needs_client
def test_the_same_flags_send_what_vllms_client_sends_and_save_its_keys(tiny_chat_model_dir: Path,
                                                                       tmp_path: Path) -> None:
    """No --temperature: neither client sends one (vLLM 0.32's default, the server's sampling); the sampling
    flags, --extra-body and the random dataset's ignore_eos alike; every key of vLLM's saved result."""
    python = next(python for python in CLIENT_PYTHONS if has_client(python))
    flags = ["--model", MODEL, "--tokenizer", str(tiny_chat_model_dir), "--dataset-name", "random",
             "--random-input-len", "8", "--random-output-len", "3", "--num-prompts", "2", "--top-p", "0.9",
             "--top-k", "20", "--extra-body", '{"seed": 3, "min_p": 0.05}', "--save-result",
             "--save-detailed", "--result-filename", "result.json"]
    recorder = Recorder()
    with recording_server(recorder) as url:
        vllm = subprocess.run(
            [str(python), "-c", CLIENT, "--base-url", url, *flags, "--result-dir", str(tmp_path / "vllm")],
            capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert vllm.returncode == 0, vllm.stdout[-3000:] + vllm.stderr[-3000:]
        vllm_bodies = list(recorder.bodies)
        recorder.bodies.clear()
        assert main(["bench", "--base-url", url, *flags, "--result-dir", str(tmp_path / "pdserve"),
                     "--out", str(tmp_path / "out"), "--disable-tqdm"]) == 0
        pdserve_bodies = list(recorder.bodies)

    def sampling(body: dict[str, object]) -> dict[str, object]:
        # Beside these both send the prompt, model, max_tokens and stream options; vLLM also its
        # repetition_penalty 1.0 and logprobs null (no-ops), pdserve return_token_ids (to count tokens).
        keys = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "max_tokens")
        return {key: body[key] for key in keys if key in body}

    assert len(vllm_bodies) == len(pdserve_bodies) == 2
    assert [sampling(b) for b in pdserve_bodies] == [sampling(b) for b in vllm_bodies] == [
        {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "seed": 3, "ignore_eos": True, "max_tokens": 3}] * 2
    vllm_result = json.loads((tmp_path / "vllm" / "result.json").read_text())
    pdserve_result = json.loads((tmp_path / "pdserve" / "result.json").read_text())
    # pdserve keeps no generated text, and has no audio input for vLLM's rtfx.
    assert set(vllm_result) - set(pdserve_result) <= {"generated_texts", "rtfx"}
    for key in ("completed", "total_output_tokens", "output_lens"):
        assert pdserve_result[key] == vllm_result[key], key
