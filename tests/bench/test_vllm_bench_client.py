"""vLLM's own `vllm bench serve` client against pdserve, without --model (benchmarks/vllm_bench_client.py).
Runs only where a Python with vLLM's benchmark client exists (it is not a dependency of pdserve)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.vllm_bench_client import DEFAULT_VENV, PREBUILT_VENV, has_client

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not any(has_client(v / "bin" / "python") for v in (DEFAULT_VENV, PREBUILT_VENV)),
                    reason=f"no vLLM benchmark client in {DEFAULT_VENV} or {PREBUILT_VENV} (the script can "
                           "install one: minutes and GBs)")
def test_vllm_bench_serve_runs_against_pdserve(tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_bench_client.py"), "--model",
                             str(tiny_chat_model_dir), "--out", str(tmp_path), "--num-prompts", "4",
                             "--input-len", "16", "--output-len", "4"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    saved = json.loads((tmp_path / "result.json").read_text())
    assert saved["completed"] == 4 and saved["failed"] == 0 and saved["total_output_tokens"] == 16
