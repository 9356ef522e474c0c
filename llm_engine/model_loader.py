"""Load a local Hugging Face model directory (llm_engine/config.py SUPPORTED_ARCHITECTURES) for the paged
engine (its shape facts are read, without torch, by llm_engine/model_files.py read_model_spec)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

import llm_engine.paged_attention as paged_attention
from llm_engine.checkpoint_config import LeanConfig, read_lean_config
from llm_engine.compilation import Body, CompileReport, compile_body
from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.hardware import check_device_present
from llm_engine.lean_loader import load_lean_model
from llm_engine.lean_model import LEAN_ARCHITECTURES, LeanBody, has_lean_body
from llm_engine.linear_probe import LinearKernelReport, apply_linear_kernel
from llm_engine.model_files import read_model_spec
from llm_engine.rank_shares import check_tensor_parallel, spec_shares
from llm_engine.tp_sharding import join_group, shard_lean_body, vocab_parallel_head

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from llm_engine.tensor_parallel import TPGroup

logger = logging.getLogger(__name__)
# Times this process loaded weights: a worker that changes role keeps its model, and reports this to prove it.
_num_loads = 0


def num_model_loads() -> int:
    return _num_loads


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for the runner: weights on the device, paged attention in, linears on their kernel."""

    # lm_head always; a LeanCausalLM (llm_engine/lean_loader.py), or transformers' model whose decoder
    # layers stay only without a lean body
    model: nn.Module
    spec: ModelSpec
    linear_kernel: LinearKernelReport  # which GEMM kernel its linear layers run on, and why
    # The engine's own body (llm_engine/lean_model.py), compiled or not; None: transformers' modules, eager.
    body: Body | None = None
    compilation: CompileReport = field(
        default_factory=lambda: CompileReport("off", False, "transformers", "not built", 0.0, None))


def load_model(config: EngineConfig, tp_group: TPGroup | None = None) -> LoadedModel:
    """Load weights with the paged attention plugged in, in eval mode, on the configured device and dtype,
    keep this rank's slice of them (tensor parallel: `tp_group`, config.tensor_parallel_size ranks), and put
    every linear layer on the fastest kernel (llm_engine/linear_kernels.py).

    Raises:
        ValueError: tensor parallelism over a family without the engine's own body, or a degree that does
            not divide the heads (the message names --tensor-parallel-size).
    """
    global _num_loads
    check_device_present(config.device)
    _num_loads += 1

    spec = read_model_spec(config.model_dir).with_max_model_len(config.max_model_len)
    tp_size = config.tensor_parallel_size
    check_tensor_parallel(spec, tp_size)
    if tp_size > 1 and not has_lean_body(spec.architecture):
        raise ValueError(f"--tensor-parallel-size {tp_size}: tensor parallelism runs on the engine's own "
                         f"body ({', '.join(LEAN_ARCHITECTURES)}); {spec.architecture} has none")
    if tp_size > 1 and (tp_group is None or tp_group.size != tp_size):
        raise ValueError(f"--tensor-parallel-size {tp_size}: this rank has no group of {tp_size} ranks")
    device = torch.device(config.device)
    lean_config = read_lean_config(config.model_dir)
    model: nn.Module
    lean: LeanBody | None = None
    if isinstance(lean_config, LeanConfig):
        # Tensor parallel: this rank reads only its slice of the layers
        rank = tp_group.rank if tp_group is not None and tp_size > 1 else 0
        share = spec_shares(spec, tp_size)[rank] if tp_size > 1 else None
        model = load_lean_model(lean_config, config.model_dir, config.torch_dtype, device, spec.max_model_len,
                                share, rank, tp_size)
        lean = model.lean_body
        if tp_group is not None and tp_size > 1:
            join_group(lean, tp_group)
            vocab_parallel_head(model, spec.vocab_size, tp_group, whole=False)
    else:
        model = _load_transformers_model(config, device)
        if has_lean_body(spec.architecture):
            # A submodule of the model, so the linear-kernel probe below sees its fused q/k/v and gate/up.
            lean = model.lean_body = LeanBody.from_hf(model, spec.max_model_len)
        if lean is not None and tp_group is not None and tp_size > 1:
            shard_lean_body(lean, tp_group)
            vocab_parallel_head(model, spec.vocab_size, tp_group, whole=True)
    kernel = apply_linear_kernel(model, config.linear_kernel, config.torch_dtype, device)
    body, compilation = compile_body(lean, config.compile, device, config.torch_dtype,
                                     no_lean_reason=f"no lean body for {spec.architecture}",
                                     in_background=config.compile_in_background)
    reader = "its files" if isinstance(lean_config, LeanConfig) else f"transformers ({lean_config})"
    logger.info(
        "loaded %s (%d layers, %d kv heads, over %d ranks) through %s as %s on %s; linears on %s (%s); "
        "body %s, %s (%s)",
        config.model_dir, spec.num_layers, spec.num_kv_heads, tp_size, reader, config.dtype, config.device,
        kernel.kernel,
        kernel.reason, compilation.body, compilation.mode, compilation.reason,
    )
    return LoadedModel(model, spec, kernel, body, compilation)


def _load_transformers_model(config: EngineConfig, device: torch.device) -> PreTrainedModel:
    """transformers' own model, the paged attention plugged in: a family without a lean body, or a config
    only transformers reads right (llm_engine/checkpoint_config.py says why)."""
    from transformers import AutoModelForCausalLM

    paged_attention.register()
    model = AutoModelForCausalLM.from_pretrained(
        config.model_dir,
        dtype=config.torch_dtype,
        attn_implementation=paged_attention.ATTENTION_NAME,
    )
    model.to(device)  # type: ignore[arg-type]
    model.eval()
    return model
