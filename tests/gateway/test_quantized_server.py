"""A quantized checkpoint through the whole server (1 prefill + 1 decode, real Ray actors, NIXL), the decode
worker keeping an 8-bit KV cache beside a prefill worker that keeps the model's (--decode-kv-cache-dtype fp8):
what each worker says it runs, tokens equal to one fp8 engine's, and a handoff that moves the prefill
worker's bytes and converts them on arrival."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llm_engine import EngineConfig, LLMEngine, SamplingParams
from llm_engine.checkpoint_quantizer import quantize_checkpoint
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.model_files import read_model_spec
from tests.helpers.servers import MODEL, serve_config, serving, whole_after

pytestmark = pytest.mark.slow
PROMPT = list(range(300, 340))  # 40 tokens: two full blocks of 16 and a partial one
SETTINGS = {"dtype": "float32", "kv_cache_dtype": "fp8"}  # the decode worker's, and the reference engine's


@pytest.fixture(scope="module")
def model_dir(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_checkpoint(tiny_chat_model_dir, tmp_path_factory.mktemp("w8a8") / "model", "W8A8")


@pytest.fixture(scope="module")
def server(model_dir: Path, ray_local: None) -> Iterator[str]:
    config = serve_config(model_dir, kv_cache_mib=4, api_key=None, max_waiting=8,
                          quantization="compressed-tensors", decode_kv_cache_dtype="fp8")
    with serving(config) as (url, _):
        yield url


@pytest.fixture
def client(server: str) -> Iterator[httpx.Client]:
    with whole_after(server) as c:
        yield c


def test_each_worker_says_it_runs_int8_weights_over_its_own_cache(client: httpx.Client,
                                                                  model_dir: Path) -> None:
    workers = {w["role"]: w["runtime"] for w in client.get("/admin/pools").json()["workers"]}
    assert {role: (r["weights"], r["kv_dtype"]) for role, r in workers.items()} == {
        "prefill": ("w8a8", "float32"), "decode": ("w8a8", "float8_e4m3fn")}
    cache = KVCacheSpec.from_model(read_model_spec(model_dir), EngineConfig(str(model_dir), **SETTINGS))
    assert workers["decode"]["kv_bytes_per_token"] == cache.bytes_per_token  # a quarter of float32's
    assert workers["prefill"]["kv_bytes_per_token"] == 4 * cache.bytes_per_token
    metrics = client.get("/metrics").text
    assert 'kv_dtype="float8_e4m3fn"' in metrics and 'kv_dtype="float32"' in metrics
    assert 'weights="w8a8"' in metrics


def test_tokens_equal_one_eight_bit_engines_and_the_handoff_converts(client: httpx.Client,
                                                                         model_dir: Path) -> None:
    engine = LLMEngine(EngineConfig(str(model_dir), kv_cache_bytes=4 << 20, compile="off", **SETTINGS))
    [alone] = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0.0))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0.0,
            "return_tokens_as_token_ids": True, "logprobs": 0}
    answer = client.post("/v1/completions", json=body).raise_for_status().json()
    tokens = [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]
    assert tokens == list(alone.output_token_ids)
    cache = KVCacheSpec.from_model(read_model_spec(model_dir), EngineConfig(str(model_dir), **SETTINGS))
    # The prompt's 3 blocks cross in the prefill worker's float32 (the decode worker converts them).
    assert answer["timings"]["transfer_bytes"] == 3 * 4 * cache.block_bytes
