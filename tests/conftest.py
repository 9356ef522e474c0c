"""Shared fixtures: small real models built in the test session, and the default model when marked slow."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llm_engine.tiny_model import build_tiny_llama

# One torch thread per process, as in the workers: 2 cores are shared by everything in a test run.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines run their model body eager (a compile per fleet start would cost the suite minutes); the compiled
# path has its own tests (tests/engine/test_compiled_engine.py). Workers get it through the EngineConfig the
# driver builds, which reads this default.
os.environ.setdefault("PDSERVE_COMPILE", "off")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local Ray instance shared by the tests that need one (about 3 s to start)."""
    import ray

    # Worker processes inherit this environment: UCX stays on loopback, tokenizers stay single-threaded.
    os.environ["UCX_NET_DEVICES"] = "lo"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny random Llama with SmolLM2's tokenizer and chat template (vocabulary 49152)."""
    out = build_tiny_llama(tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy2(smollm2_dir / name, out / name)
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from llm_engine.default_model import prepare_default_model

    return prepare_default_model()


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, ignore_eos: bool = False) -> list[list[int]]:
    """Reference: transformers `generate`, one prompt at a time (no padding), greedy, stopping at EOS
    (unless `ignore_eos`: then exactly max_new_tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens if ignore_eos else 0)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="session")
def qwen3_small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3 checkpoint that thinks on cue, Qwen3's tokenizer and template (tests/qwen3_small.py)."""
    from tests.qwen3_small import build_qwen3_small

    return build_qwen3_small(tmp_path_factory.mktemp("qwen3-small"))
