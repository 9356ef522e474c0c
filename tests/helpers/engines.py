"""Engines and worker pairs built in the test process (no Ray): an LLMEngine on a model folder, and a prefill
and a decode worker wired over a transfer backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from decode_pool.messages import DecodeOutput, DecodeRequest
from decode_pool.worker import DecodeWorker
from kv_transfer import TransferConfig, make_receiver, make_sender
from llm_engine import EngineConfig, KVCacheSpec, LLMEngine, SamplingParams
from llm_engine.model_files import read_model_spec
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.scheduler import PrefillScheduler
from prefill_pool.worker import PrefillWorker


def make_engine(model_dir: Path, num_blocks: int = 256, **overrides: object) -> LLMEngine:
    spec = read_model_spec(model_dir)
    cache_spec = KVCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, torch.float32)
    block_bytes = cache_spec.block_bytes
    # float32 unless a test names another: the reference is transformers in float32.
    settings: dict[str, object] = {"dtype": "float32", "kv_cache_bytes": num_blocks * block_bytes}
    settings.update(overrides)
    return LLMEngine(EngineConfig(str(model_dir), **settings))  # type: ignore[arg-type]


def make_pair(model_dir: Path, decode_blocks: int = 256, lease_s: float = 30.0,
              budget: int = 64, prefill_blocks: int | None = None, backend: str = "local",
              prefill_settings: dict[str, object] | None = None,
              decode_settings: dict[str, object] | None = None,
              transfer_config: TransferConfig | None = None) -> tuple[PrefillWorker, DecodeWorker]:
    """`prefill_settings` / `decode_settings`: EngineConfig fields beyond float32 (a KV cache dtype);
    `transfer_config`: both halves' (a wire dtype), else one with `lease_s`."""
    prefill_extra: dict[str, Any] = {"dtype": "float32", **(prefill_settings or {})}
    decode_extra: dict[str, Any] = {"dtype": "float32", **(decode_settings or {})}
    prefill_config = EngineConfig(str(model_dir), kv_cache_bytes=8 << 20, max_num_batched_tokens=budget,
                                  **prefill_extra)
    if prefill_blocks is not None:
        block_bytes = LLMEngine(prefill_config).runner.cache_spec.block_bytes
        prefill_config = EngineConfig(str(model_dir), kv_cache_bytes=prefill_blocks * block_bytes,
                                      max_num_batched_tokens=budget, **prefill_extra)
    prefill_engine = LLMEngine(prefill_config, scheduler_cls=PrefillScheduler)
    sized = EngineConfig(str(model_dir), **decode_extra)
    decode_block_bytes = KVCacheSpec.from_model(read_model_spec(model_dir), sized).block_bytes
    decode_engine = LLMEngine(EngineConfig(str(model_dir), kv_cache_bytes=decode_blocks * decode_block_bytes,
                                           **decode_extra),
                              watermark=0.05)
    config = transfer_config or TransferConfig(lease_s=lease_s)
    sender = make_sender(backend, "p0", prefill_engine.runner.kv_cache, config=config)
    receiver = make_receiver(backend, "d0", decode_engine.runner.kv_cache, config=config)
    prefill = PrefillWorker("p0", prefill_engine, sender)
    decode = DecodeWorker("d0", decode_engine, receiver)
    decode.add_peer(sender.peer_info())
    return prefill, decode


HANDOFF_GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def run_handoff(prefill: PrefillWorker, decode: DecodeWorker, prompts: list[list[int]],
                sampling: SamplingParams = HANDOFF_GREEDY) -> dict[str, list[int]]:
    """Each prompt prefilled by `prefill`, its KV handed to `decode`, decoded there: stepped by hand. Returns
    each request's tokens (r0, r1, ... in prompt order)."""
    results: list[PrefillResult] = []
    tokens: dict[str, list[int]] = {}
    finished: dict[str, DecodeOutput] = {}

    def on_output(out: DecodeOutput) -> None:
        tokens[out.request_id].extend(out.token_ids)
        if out.finish_reason:
            finished[out.request_id] = out

    for index, prompt in enumerate(prompts):
        prefill.submit(PrefillRequest(f"r{index}", tuple(prompt), sampling), results.append)
    for _ in range(10_000):
        prefill.step()
        while results:
            result = results.pop(0)
            tokens[result.request_id] = [result.first_token_id]
            if result.finish_reason is None:
                decode.submit(DecodeRequest(result.request_id, tuple(prompts[int(result.request_id[1:])]),
                                            sampling, result.first_token_id, result.first_logprob,
                                            result.kv_handle), on_output)
            else:
                finished[result.request_id] = DecodeOutput(result.request_id, (), (), 0.0,
                                                           result.finish_reason)
        decode.step()
        if len(finished) == len(prompts):
            break
    prefill.step()  # the sender sees the last pulls and releases their blocks
    assert len(finished) == len(prompts)
    return tokens
