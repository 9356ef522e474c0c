"""KV sizing (llm_engine/kv_sizing.py): memory settings parse, a memory budget gives the expected blocks on a
CPU and on CUDA (arithmetic only: the device's memory is given), bad settings are refused by name, and an
engine's context can be shortened but not lengthened."""

from __future__ import annotations

import fcntl
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from llm_engine import EngineConfig, LLMEngine, ModelSpec, SamplingParams, node_locks
from llm_engine import engine as engine_module
from llm_engine.config import CPU_KV_CACHE_BYTES
from llm_engine.hardware import DeviceMemory, cgroup_memory, ram
from llm_engine.kv_sizing import (
    NON_TORCH_BYTES,
    MemoryAmount,
    activation_reserve_bytes,
    kv_budget,
    parse_memory,
    plan_kv_cache,
)
from llm_engine.node_locks import node_memory_lock

GiB, MiB = 1 << 30, 1 << 20
# An 8B Llama's shape: 32 layers × 8 KV heads × 128 head dim × 2 (K, V) × 2 bytes (bf16) = 128 KiB per token,
# 2 MiB per block of 16 tokens.
LLAMA_8B = ModelSpec("LlamaForCausalLM", num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                     hidden_size=4096, intermediate_size=14336, vocab_size=128256, max_model_len=8192,
                     eos_token_ids=(2,))
BLOCK_BYTES = 2 * MiB


def cpu_ram(free: int) -> DeviceMemory:
    return DeviceMemory(total=64 * GiB, free=free, weights=0, held=0)


@pytest.mark.parametrize(("text", "amount"), [
    ("2GiB", MemoryAmount(num_bytes=2 * GiB)), ("512MiB", MemoryAmount(num_bytes=512 * MiB)),
    ("512 mib", MemoryAmount(num_bytes=512 * MiB)), ("1.5G", MemoryAmount(num_bytes=3 * GiB // 2)),
    ("4GB", MemoryAmount(num_bytes=4 * 10**9)), ("1048576", MemoryAmount(num_bytes=MiB)),
    ("0.2", MemoryAmount(fraction=0.2)), ("1.0", MemoryAmount(fraction=1.0)),
    (0.5, MemoryAmount(fraction=0.5)), (4096, MemoryAmount(num_bytes=4096)),
])
def test_memory_settings_parse(text: str | int | float, amount: MemoryAmount) -> None:
    assert parse_memory(text) == amount


@pytest.mark.parametrize("text", ["", "2XB", "-1GiB", "1.5", "0", "0.0", "GiB", "2 GiB extra", 0, 1.5])
def test_bad_memory_settings_say_what_is_accepted(text: str | int | float) -> None:
    with pytest.raises(ValueError, match="fraction in"):
        parse_memory(text)


def test_a_cpu_fraction_of_free_ram_gives_its_blocks() -> None:
    config = EngineConfig("m", dtype="bfloat16", kv_cache_fraction=0.25)
    capacity = plan_kv_cache(config, LLAMA_8B, cpu_ram(free=16 * GiB))
    assert capacity.num_blocks == 4 * GiB // BLOCK_BYTES == 2048
    assert (capacity.num_tokens, capacity.num_bytes) == (2048 * 16, 4 * GiB)
    assert "0.25 of 16.00 GiB free RAM" in capacity.describe()


def test_ram_is_the_containers_where_a_cgroup_limits_it(tmp_path: Path) -> None:
    """Review N12: /proc/meminfo shows the host's RAM; in a pod limited to less, a fraction of the host's
    got the pod OOM-killed. The cgroup's limit (v2, or v1) bounds both figures; no limit changes nothing."""
    host_total, host_available = ram(tmp_path)  # no cgroup files here: the host's figures
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 << 30}\n")
    (v2 / "memory.current").write_text(f"{1 << 30}\n")
    assert cgroup_memory(v2) == (4 << 30, 1 << 30)
    assert ram(v2) == (min(host_total, 4 << 30), min(host_available, 3 << 30))
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(2 << 30))
    assert ram(v1)[1] == 0  # at its limit: nothing is available, whatever the host has free
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory(v2) is None and ram(v2)[0] == host_total


def test_cpu_bytes_and_the_cpu_default() -> None:
    named = plan_kv_cache(EngineConfig("m", dtype="bfloat16", kv_cache_bytes=GiB + 3), LLAMA_8B,
                          cpu_ram(8 * GiB))
    assert named.num_blocks == 512  # whole blocks only
    default = plan_kv_cache(EngineConfig("m", dtype="float32"), LLAMA_8B, cpu_ram(8 * GiB))
    assert default.num_blocks == CPU_KV_CACHE_BYTES // (2 * BLOCK_BYTES)  # float32: 4 MiB blocks
    with pytest.raises(ValueError, match=r"does not fit in the 1\.00 GiB of free RAM.*--kv-cache-memory"):
        kv_budget(EngineConfig("m", kv_cache_bytes=2 * GiB), cpu_ram(GiB), activation_bytes=0)


def test_cuda_utilization_leaves_out_weights_activations_and_the_context() -> None:
    config = EngineConfig("m", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9)
    memory = DeviceMemory(total=80 * GiB, free=60 * GiB, weights=16 * GiB, held=17 * GiB)
    budget = kv_budget(config, memory, activation_bytes=4 * GiB)
    assert budget.num_bytes == 72 * GiB - 16 * GiB - 4 * GiB - NON_TORCH_BYTES
    # With the estimate of this config's activations, as the engine does it.
    activation = activation_reserve_bytes(LLAMA_8B, config, dtype_bytes=2)
    capacity = plan_kv_cache(config, LLAMA_8B, memory)
    assert capacity.num_blocks == (72 * GiB - 16 * GiB - activation - NON_TORCH_BYTES) // BLOCK_BYTES
    assert "0.9 of 80.00 GiB GPU memory" in capacity.source


def test_cuda_utilization_leaves_out_the_scratch_of_a_tensor_parallel_ranks_transfers() -> None:
    """Two ranks reading their heads where they live (NIXL): no staging copy in the budget, the transfer
    layer's scratch out of it (each rank's block: 4 of the 8 KV heads, 1 MiB)."""
    config = EngineConfig("m", device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9,
                          tensor_parallel_size=2, tp_staging=False)
    memory = DeviceMemory(total=80 * GiB, free=70 * GiB, weights=8 * GiB, held=9 * GiB)
    without = plan_kv_cache(config, LLAMA_8B, memory)
    scratch = plan_kv_cache(replace(config, transfer_scratch_bytes=64 * MiB), LLAMA_8B, memory)
    assert without.num_blocks - scratch.num_blocks == 64
    staged = plan_kv_cache(replace(config, tp_staging=True), LLAMA_8B, memory)
    assert staged.num_blocks == without.num_blocks // 3  # each block's 1 MiB plus a whole-head 2 MiB copy


def test_cuda_refuses_a_utilization_beyond_the_free_memory_or_that_leaves_nothing() -> None:
    config = EngineConfig("m", device="cuda", gpu_memory_utilization=0.9)
    others_hold_half = DeviceMemory(total=80 * GiB, free=23 * GiB, weights=16 * GiB, held=17 * GiB)
    with pytest.raises(ValueError, match=r"less than --gpu-memory-utilization 0\.9 asks for"):
        kv_budget(config, others_hold_half, activation_bytes=GiB)
    small = EngineConfig("m", device="cuda", gpu_memory_utilization=0.2)
    with pytest.raises(ValueError, match="leaves no room for the KV cache"):
        kv_budget(small, DeviceMemory(80 * GiB, 79 * GiB, 16 * GiB, 16 * GiB), activation_bytes=GiB)


def test_cuda_named_bytes_or_a_fraction_of_free_memory_take_no_activation_reserve() -> None:
    memory = DeviceMemory(total=80 * GiB, free=60 * GiB, weights=16 * GiB, held=16 * GiB)
    fraction = plan_kv_cache(EngineConfig("m", device="cuda", dtype="bfloat16", kv_cache_fraction=0.5),
                             LLAMA_8B, memory)
    assert fraction.num_blocks == 30 * GiB // BLOCK_BYTES
    named = plan_kv_cache(EngineConfig("m", device="cuda", dtype="bfloat16", kv_cache_bytes=10 * GiB),
                          LLAMA_8B, memory)
    assert named.num_blocks == 10 * GiB // BLOCK_BYTES
    with pytest.raises(ValueError, match="free GPU memory"):
        kv_budget(EngineConfig("m", device="cuda", kv_cache_bytes=70 * GiB), memory, activation_bytes=0)


def test_activation_estimate_adds_up_its_terms() -> None:
    spec = ModelSpec("LlamaForCausalLM", num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     hidden_size=32, intermediate_size=64, vocab_size=100, max_model_len=128,
                     eos_token_ids=())
    config = EngineConfig("m", max_num_batched_tokens=16, max_num_seqs=4)
    hidden = 16 * (4 * 32 + (4 + 2 * 2) * 8 + 3 * 64) * 2
    prefill_scores = 2 * 4 * 16 * 128 * 2
    decode_kv = 4 * 128 * 2 * 2 * 8 * 2
    logits = 3 * (4 + 256) * 100 * 4
    estimate = activation_reserve_bytes(spec, config, dtype_bytes=2)
    assert estimate == hidden + prefill_scores + decode_kv + logits


@pytest.mark.parametrize(("settings", "needle"), [
    ({"kv_cache_bytes": GiB, "kv_cache_fraction": 0.5}, "not both"),
    ({"kv_cache_fraction": 1.5}, "kv_cache_fraction must be in (0, 1]"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization must be in (0, 1]"),
    ({"max_model_len": 0}, "max_model_len must be >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
])
def test_engine_config_refuses_bad_sizing(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("]", r"\]")):
        EngineConfig("m", **settings)  # type: ignore[arg-type]


def test_max_model_len_shortens_the_context_only() -> None:
    assert LLAMA_8B.with_max_model_len(None) is LLAMA_8B
    assert LLAMA_8B.with_max_model_len(4096).max_model_len == 4096
    with pytest.raises(ValueError, match="--max-model-len 9000 exceeds the model's context of 8192"):
        LLAMA_8B.with_max_model_len(9000)


def test_an_engine_with_a_short_context_refuses_longer_requests(tiny_llama_dir: Path) -> None:
    config = EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_fraction=0.001, max_model_len=64,
                          max_num_seqs=3)
    engine = LLMEngine(config)
    assert engine.spec.max_model_len == 64 and engine.scheduler.max_num_seqs == 3
    assert engine.kv_capacity.num_blocks == engine.block_pool.num_blocks >= 1
    with pytest.raises(ValueError, match="maximum context length of 64 tokens"):
        engine.add_request([1] * 60, SamplingParams(max_tokens=10))
    [done] = engine.generate([[1] * 50], SamplingParams(max_tokens=14, ignore_eos=True))
    assert len(done.output_token_ids) == 14
    with pytest.raises(ValueError, match="--max-model-len 2000 exceeds the model's context of 1024"):
        LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_bytes=4 * MiB,
                               max_model_len=2000))


def test_workers_on_one_node_measure_and_allocate_one_after_the_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama_dir: Path) -> None:
    """Review N12: two workers starting at once with a fraction each measured the same free memory. The
    node's lock makes the second measure only once the first has allocated its cache."""
    monkeypatch.setattr(node_locks, "MEMORY_LOCK_DIR", tmp_path)
    steps: list[tuple[str, str]] = []

    def start(name: str) -> None:
        with node_memory_lock("cpu"):
            steps.append((name, "measured"))
            time.sleep(0.3)  # an allocation being written
            steps.append((name, "allocated"))

    workers = [threading.Thread(target=start, args=(name,)) for name in ("a", "b")]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert [step for _, step in steps] == ["measured", "allocated"] * 2
    assert steps[0][0] == steps[1][0] and steps[2][0] == steps[3][0]

    # The engine measures the free memory under that lock: another worker's attempt to take it fails then.
    def measured_while_locked(device: str) -> DeviceMemory:
        with (tmp_path / "pdserve-kv-sizing-cpu.lock").open("a") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return ram_now(device)

    ram_now = engine_module.device_memory
    monkeypatch.setattr(engine_module, "device_memory", measured_while_locked)
    engine = LLMEngine(EngineConfig(str(tiny_llama_dir), dtype="float32", kv_cache_fraction=0.001))
    assert engine.kv_capacity.num_blocks >= 1
