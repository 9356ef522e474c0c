"""`pdserve tune profile` on the tiny random Llama: a valid profile.json and its plot."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.helpers.tuning import tune
from tuner.profile import load_profile


def test_profile_of_the_tiny_model_writes_a_valid_profile(tiny_llama_dir: Path, tmp_path: Path) -> None:
    status = tune(["profile", "--model", str(tiny_llama_dir), "--quick", "--kv-cache-mib", "16",
                   "--no-progress", "--out", str(tmp_path)])

    assert status == 0
    profile = load_profile(tmp_path / "profile.json")
    assert profile.model == tiny_llama_dir.name and profile.vocab_size == 1000
    assert {p.kind for p in profile.steps} == {"prefill", "decode", "mixed"}
    assert profile.transfers and all(p.seconds > 0 for p in profile.transfers)
    assert profile.shape.num_blocks == (16 << 20) // profile.shape.block_bytes
    # The fits price what was measured: typically within a factor of 3 of a forward's timing, each within 10
    # (a timing on a shared machine can take a stall: one point at 3.6x failed a run under a profiler).
    ratios = [profile.fits.step_s(p.batch, p.context, p.prefill_tokens, p.prefill_pairs) / p.seconds
              for p in profile.steps]
    assert 1 / 3 < statistics.median(ratios) < 3, ratios
    assert all(1 / 10 < ratio < 10 for ratio in ratios), ratios
    assert (tmp_path / "profile.png").stat().st_size > 0


def test_a_missing_model_directory_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tune(["profile", "--model", str(tmp_path / "nowhere"), "--quick", "--out", str(tmp_path)])
    assert "--model" in capsys.readouterr().err
