"""`pdserve quantize`: an unquantized checkpoint of the engine's own families written again with integer
weights in compressed-tensors' format (what vLLM and transformers load, what llm-compressor writes).

    quantize_checkpoint(model_dir, out_dir, "W8A8" | "W8A16" | "W4A16" | "W4A16_ASYM", group_size)
        → out_dir: config.json with its quantization_config, model.safetensors, the tokenizer files
Round to nearest (llm-compressor's QuantizationModifier, no calibration pass): every decoder layer's seven
linears, scales from each output channel's (int8) or each group of input columns' (int4) extremes through
compressed-tensors' own `calculate_qparams` and `quantize`, int4 values packed by its `pack_to_int32`; the
lm_head and the embeddings are kept, as llm-compressor's recipes keep them. W8A8's activations need no
calibration either: they are quantized per token at run time. What round to nearest costs against a calibrated
method (GPTQ) is measured in docs/models.md; a GPTQ checkpoint made by llm-compressor loads the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from llm_engine.checkpoint_config import SAFETENSORS_FILE, LeanConfig, read_lean_config
from llm_engine.lean_loader import tensor_files
from llm_engine.weight_schemes import GROUP_SIZES, LINEAR_SUFFIXES, QUANTIZE_SCHEMES

DEFAULT_GROUP_SIZE = 128  # llm-compressor's; a model whose widths it does not divide takes the next smaller
# Written beside the weights: the tokenizer, the chat template, the generation defaults.
_KEPT_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
               "chat_template.jinja", "chat_template.json")


def _group_size(config: LeanConfig, asked: int | None) -> int:
    """The group size every quantized linear's input width divides (SmolLM2's 576 takes 64, not 128).

    Raises:
        ValueError: `asked` does not divide a width, or no supported size does.
    """
    if asked is not None and asked not in GROUP_SIZES:
        raise ValueError(f"--group-size {asked}: the int4 kernels take groups of "
                         f"{', '.join(map(str, GROUP_SIZES))} columns")
    widths = {config.hidden_size, config.intermediate_size, config.num_heads * config.head_dim}
    sizes = ((asked,) if asked is not None
             else tuple(s for s in reversed(GROUP_SIZES) if s <= DEFAULT_GROUP_SIZE))
    for size in sizes:
        if all(width % size == 0 for width in widths):
            return size
    raise ValueError(f"--group-size {asked if asked is not None else DEFAULT_GROUP_SIZE}: the model's input "
                     f"widths {sorted(widths)} are not all divisible by "
                     + (str(asked) if asked is not None else f"any of {', '.join(map(str, GROUP_SIZES))}"))


def _scheme(name: str, group_size: int) -> Any:  # compressed-tensors' QuantizationScheme
    """compressed-tensors' own preset (llm-compressor's), with the int4 groups sized to the model. W8A16 is
    the one departure: its preset groups int8 weights by 128 columns, which torch's int8 kernel (one scale
    per output channel) does not take, so W8A16 here is int8 per channel."""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    if name.startswith("W4A16"):
        scheme.weights.group_size = group_size
    elif name == "W8A16":
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    return scheme


def _quantize_weight(weight: torch.Tensor, args: Any, packed: bool, store_dtype: torch.dtype
                     ) -> dict[str, torch.Tensor]:
    """One linear's compressed tensors (the names compressed-tensors gives them, without the prefix)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = weight.to(torch.float32)
    rows, columns = w.shape
    by_group = w.reshape(rows, -1, args.group_size) if args.group_size else w[:, None, :]
    scale, zero = calculate_qparams(by_group.amin(-1), by_group.amax(-1), args)  # [rows, groups]
    zero = zero.round().to(torch.int8)
    values = quantize(w, scale, zero, args, dtype=torch.int8)
    out = {"weight_scale": scale.to(store_dtype)}
    if not packed:
        out["weight"] = values
        return out
    out["weight_packed"] = pack_to_int32(values, args.num_bits)
    out["weight_shape"] = torch.tensor([rows, columns], dtype=torch.int64)
    if not args.symmetric:
        out["weight_zero_point"] = pack_to_int32(zero, args.num_bits, packed_dim=0)
    return out


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, scheme: str = "W8A8",
                        group_size: int | None = None) -> Path:
    """Write `model_dir`'s checkpoint with `scheme`'s integer weights into `out_dir` (created).

    Raises:
        ValueError: an unknown scheme (the message names --scheme), a model that is not of the engine's own
            families, one already quantized, or widths the groups do not divide (naming --group-size).
    """
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors import safe_open
    from safetensors.torch import save_file

    scheme = scheme.upper()
    if scheme not in QUANTIZE_SCHEMES:
        raise ValueError(f"--scheme {scheme!r}: choose one of {', '.join(QUANTIZE_SCHEMES)}")
    source, out = Path(model_dir), Path(out_dir)
    raw = json.loads((source / "config.json").read_text())
    if raw.get("quantization_config"):
        raise ValueError(f"{source} is quantized already: quantize its unquantized checkpoint")
    config = read_lean_config(source)
    if not isinstance(config, LeanConfig):
        raise ValueError(f"{source}: `pdserve quantize` writes the engine's own families' checkpoints, and "
                         f"this one needs transformers' reading ({config})")
    size = _group_size(config, group_size) if scheme.startswith("W4A16") else None
    quant_scheme = _scheme(scheme, size or 0)
    packed = scheme != "W8A8"  # weight-only schemes packed into int32 words, as llm-compressor writes them
    linears = {f"model.layers.{i}.{suffix}.weight" for i in range(config.num_layers)
               for suffix in LINEAR_SUFFIXES}
    tensors: dict[str, torch.Tensor] = {}
    for path in tensor_files(source):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # a safetensors handle, not a dict
                tensor = handle.get_tensor(name)
                if name not in linears:
                    tensors[name] = tensor
                    continue
                prefix = name.removesuffix(".weight")
                compressed = _quantize_weight(tensor, quant_scheme.weights, packed, tensor.dtype)
                tensors.update({f"{prefix}.{key}": value for key, value in compressed.items()})
    if config.tie_word_embeddings:  # one tensor for both, as transformers ties them
        tensors.pop("lm_head.weight", None)
    quantization = QuantizationConfig(
        config_groups={"group_0": quant_scheme}, quant_method="compressed-tensors",
        format="pack-quantized" if packed else "int-quantized", quantization_status="compressed",
        ignore=["lm_head"])
    raw["quantization_config"] = quantization.model_dump(mode="json")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / SAFETENSORS_FILE),
              metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for name in _KEPT_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
