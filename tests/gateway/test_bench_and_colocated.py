"""`pdserve bench` against the real server, and the colocated baseline behind the same gateway."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.app import create_app
from gateway.config import ServeConfig
from llm_engine.model_loader import load_tokenizer
from tests.conftest import hf_greedy
from tests.gateway.conftest import API_KEY, MODEL, free_port, wait_until_no_blocks_used

pytestmark = pytest.mark.slow


def test_pdserve_bench_writes_results_matching_what_it_sent(server: str, tmp_path: Path) -> None:
    out = tmp_path / "bench"
    command = [
        sys.executable,
        "-m",
        "pdserve",
        "bench",
        "--url",
        server,
        "--rate",
        "8",
        "--num-requests",
        "12",
        "--input-len",
        "20",
        "--output-len",
        "6",
        "--vocab-size",
        "49152",
        "--api-key",
        API_KEY,
        "--out",
        str(out),
        "--no-progress",
        "--ttft-slo",
        "5",
        "--itl-slo",
        "1",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert len(records) == summary["num_requests"] == 12
    assert summary["num_ok"] + summary["num_errors"] == 12 and summary["num_ok"] == 12
    assert all(r["num_output_tokens"] == 6 and r["timings"] for r in records)
    assert summary["stage_ms_over_requests"]["prefill_ms"]["p50"] > 0
    assert 0 < summary["goodput"] <= summary["request_throughput"]
    for png in ("latency_cdf.png", "stage_breakdown.png", "queues_over_time.png"):
        assert (out / png).stat().st_size > 0
    assert (out / "metrics.jsonl").read_text().strip()


def test_bench_flag_errors_name_the_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "bench", "--input-len", "5", "--output-len", "5"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "--rate" in result.stderr


@pytest.fixture(scope="module")
def colocated_server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    config = ServeConfig(dtype="float32", model=str(tiny_chat_model_dir),
        served_model_name=MODEL,
        colocated=2,
        port=free_port(),
        kv_cache_mib=4,
        max_num_batched_tokens=64,
        api_key=API_KEY,
    )
    uv = uvicorn.Server(
        uvicorn.Config(create_app(config), host=config.host, port=config.port, log_level="warning")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        assert thread.is_alive(), "pdserve did not start"
        time.sleep(0.1)
    yield f"http://{config.host}:{config.port}"
    uv.should_exit = True
    thread.join(60)


def test_colocated_workers_serve_the_same_tokens(colocated_server: str, tiny_chat_model_dir: Path) -> None:
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    prompts = [
        "A long time ago in a galaxy far away",
        "Hello",
        "One two three four five six seven eight nine",
    ]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=colocated_server, headers=headers, timeout=120) as client:
        pools = client.get("/admin/pools").json()
        assert (pools["prefill"], pools["decode"], pools["mixed"]) == (0, 0, 2)  # counted by kind
        for prompt in prompts:
            body = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 10,
                "temperature": 0,
                "return_token_ids": True,
            }
            data = client.post("/v1/completions", json=body).json()
            expected = hf_greedy(tiny_chat_model_dir, [tokenizer.encode(prompt)], 10)[0]
            assert data["choices"][0]["token_ids"] == expected
            timings = data["timings"]
            assert timings["transfer_bytes"] == 0 and timings["prefill_ms"] > 0 and timings["decode_ms"] > 0
        assert wait_until_no_blocks_used(client) == 0
