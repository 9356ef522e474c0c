"""profile → plan → apply → validate against a real server (tiny model, two workers, small numbers)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.helpers.servers import serve_config, serving
from tests.helpers.tuning import tune


@pytest.mark.slow
def test_profile_plan_apply_validate_on_a_live_server(
        tiny_chat_model_dir: Path, ray_local: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_chat_model_dir.name  # what the profile names, and so what the server must serve
    config = serve_config(tiny_chat_model_dir, served_model_name=model, api_key=None, kv_cache_mib=16,
                          max_waiting=256, max_num_batched_tokens=512)
    assert tune(["profile", "--model", str(tiny_chat_model_dir), "--quick", "--kv-cache-mib", "16",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    with serving(config) as (url, _):
        assert tune(["plan", "--profile", str(tmp_path / "profile.json"), "--input-len", "32",
                     "--output-len", "8", "--rates", "2,8", "--workers", "2", "--num-requests", "16",
                     "--no-progress", "--out", str(tmp_path), "--apply", url]) == 0
        plan = json.loads((tmp_path / "plan.json").read_text())
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        assert {kind: pools[kind] for kind in ("prefill", "decode", "mixed")} == plan["recommended"]

        assert tune(["validate", "--url", url, "--plan", str(tmp_path / "plan.json"), "--layouts", "1P+1D,2M",
                     "--no-progress", "--out", str(tmp_path / "validate")]) == 0

    printed = capsys.readouterr().out
    assert "applied" in printed and "predicted best" in printed
    validation = json.loads((tmp_path / "validate" / "validation.json").read_text())
    assert {(row["label"], row["rate"]) for row in validation} == {
        (label, rate) for label in ("1P+1D", "2M") for rate in (2.0, 8.0)}
    for row in validation:
        assert row["measured"]["TTFT p50"] > 0 and row["predicted"]["TTFT p50"] > 0
