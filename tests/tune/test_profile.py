"""`pdserve tune profile` on the tiny random Llama: a valid profile.json and its plot, in seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.tuning import tune
from tuner.profile import load_profile


def test_profile_of_the_tiny_model_writes_a_valid_profile_quickly(tiny_llama_dir: Path, tmp_path: Path
                                                                   ) -> None:
    started = time.perf_counter()
    status = tune(["profile", "--model", str(tiny_llama_dir), "--quick", "--kv-cache-mib", "16",
                   "--no-progress", "--out", str(tmp_path)])

    assert status == 0
    assert time.perf_counter() - started < 60
    profile = load_profile(tmp_path / "profile.json")
    assert profile.model == tiny_llama_dir.name and profile.vocab_size == 1000
    assert {p.kind for p in profile.steps} == {"prefill", "decode", "mixed"}
    assert profile.transfers and all(p.seconds > 0 for p in profile.transfers)
    assert profile.shape.num_blocks == (16 << 20) // profile.shape.block_bytes
    # The fits price what was measured: a forward's prediction is within a factor of its timing.
    for point in profile.steps:
        predicted = profile.fits.step_s(point.batch, point.context, point.prefill_tokens, point.prefill_pairs)
        assert point.seconds / 3 < predicted < point.seconds * 3
    assert (tmp_path / "profile.png").stat().st_size > 0


def test_a_missing_model_directory_names_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        tune(["profile", "--model", str(tmp_path / "nowhere"), "--quick", "--out", str(tmp_path)])
    assert "--model" in capsys.readouterr().err
