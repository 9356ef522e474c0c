"""SmolLM2 (9 query heads, 3 KV heads) through 1 prefill + 1 decode worker on Ray at each pair of degrees
the issue asks for, one fleet changed by PUT /admin/pools: prefill at two ranks (6 + 3 heads, 2 + 1 KV
heads) and decode at one, then decode at two, then prefill at one. Greedy float32 tokens equal one rank's
every time, and the KV is handed over, not recomputed: each decode rank reads its heads from the prefill
ranks that hold them (kv_transfer/head_slices.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llm_engine import EngineConfig, LLMEngine
from llm_engine.params import SamplingParams
from tests.helpers.servers import MODEL, serve_config, serving, whole_after

pytestmark = pytest.mark.slow
PROMPT = list(range(300, 364))
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, ray_local: None) -> Iterator[str]:
    config = serve_config(smollm2_dir, prefill=1, decode=1, prefill_tp=2, cpus_per_worker=0.5, backend="nixl",
                          kv_cache_mib=24, api_key=None, max_waiting=8, max_num_batched_tokens=256)
    with serving(config, start_timeout_s=300) as (url, _):
        yield url


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:
        yield c


def test_smollm2_at_two_ranks_and_one_hands_kv_both_ways_with_one_ranks_greedy_tokens(
        client: httpx.Client, smollm2_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(str(smollm2_dir), dtype="float32", device="cpu", compile="off",
                                    kv_cache_bytes=24 << 20))
    [done] = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    one_rank = list(done.output_token_ids)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True}
    for change in (None, {"decode_tp": 2}, {"prefill_tp": 1}):  # 2 → 1, then 2 → 2, then 1 → 2
        if change is not None:
            answer = client.put("/admin/pools", json={"prefill": 1, "decode": 1, **change})
            assert answer.status_code == 200 and answer.json()["error"] == "", answer.text
        workers = client.get("/admin/pools").json()["workers"]
        degrees = {w["role"]: w["runtime"]["tensor_parallel_size"] for w in workers}
        handoffs = {w["runtime"]["tp_kv_handoff"] for w in workers if degrees[w["role"]] > 1}
        assert handoffs == {"rank slices"}  # each rank's heads read where they live, through NIXL
        # 3 KV heads over 2 ranks are 2 + 1: a token's KV is the same bytes at either degree.
        assert len({w["runtime"]["kv_bytes_per_token"] for w in workers}) == 1, workers
        response = client.post("/v1/completions", json=body)
        assert response.json()["choices"][0]["token_ids"] == one_rank, degrees
        assert response.json()["timings"]["transfer_bytes"] > 0, degrees
    assert degrees == {"prefill": 1, "decode": 2}
