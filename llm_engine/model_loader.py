"""Load a local Hugging Face model directory (Llama / Mistral / Qwen2 families) for the paged engine."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from llm_engine import paged_attention
from llm_engine.config import SUPPORTED_ARCHITECTURES, EngineConfig, ModelSpec
from llm_engine.linear_kernels import LinearKernelReport, apply_linear_kernel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
# Times this process loaded weights: a worker that changes role keeps its model, and reports this to prove it.
_num_loads = 0


def num_model_loads() -> int:
    return _num_loads


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read and check a model directory's config.json without loading weights.

    Raises:
        FileNotFoundError: the directory or its config.json does not exist.
        ValueError: the architecture is not one the engine supports.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face model directory")
    raw = json.loads(config_path.read_text())
    architectures = raw.get("architectures") or []
    supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"unsupported architecture {architectures or raw.get('model_type')!r} in {str(path)!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    num_heads = raw["num_attention_heads"]
    max_model_len = raw.get("max_position_embeddings", 2048)
    # The paged attention is full attention; a sliding window only changes results past the window, so cap
    # the context there rather than serve wrong tokens.
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", True):
        max_model_len = min(max_model_len, window)
    eos = raw.get("eos_token_id")
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelSpec(
        architecture=supported[0],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=raw.get("num_key_value_heads", num_heads),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        hidden_size=raw["hidden_size"],
        intermediate_size=raw.get("intermediate_size", 4 * raw["hidden_size"]),
        vocab_size=raw["vocab_size"],
        max_model_len=max_model_len,
        eos_token_ids=eos_ids,
    )


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner: weights on the device, paged attention in, linears on their kernel."""

    model: PreTrainedModel
    spec: ModelSpec
    linear_kernel: LinearKernelReport  # which GEMM kernel its linear layers run on, and why


def load_model(config: EngineConfig) -> LoadedModel:
    """Load weights with the paged attention plugged in, in eval mode, on the configured device and dtype,
    and put every linear layer on the fastest kernel (llm_engine/linear_kernels.py)."""
    from transformers import AutoModelForCausalLM

    global _num_loads
    _num_loads += 1

    spec = read_model_spec(config.model_dir).with_max_model_len(config.max_model_len)
    paged_attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        config.model_dir,
        dtype=config.torch_dtype,
        attn_implementation=paged_attention.ATTENTION_NAME,
    )
    model.to(torch.device(config.device))  # type: ignore[arg-type]
    model.eval()
    kernel = apply_linear_kernel(model, config.linear_kernel, config.torch_dtype, torch.device(config.device))
    logger.info(
        "loaded %s (%d layers, %d kv heads) as %s on %s; linears on %s (%s)",
        config.model_dir, spec.num_layers, spec.num_kv_heads, config.dtype, config.device, kernel.kernel,
        kernel.reason,
    )
    return LoadedModel(model, spec, kernel)


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    read_model_spec(model_dir)
    return AutoTokenizer.from_pretrained(str(model_dir))
