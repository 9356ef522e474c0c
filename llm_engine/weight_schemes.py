"""What a checkpoint's `quantization_config` says about its linear layers' weights, read without torch (the
gateway refuses an unsupported checkpoint at start, before any worker loads it).

    read_weight_scheme(config.json's dict) → WeightScheme (per layer: LayerQuant or None), or None
    check_quantization_flag(-q's value, scheme)   vLLM's `-q/--quantization` names, checked against the file
The formats are compressed-tensors' (vLLM's own: what llm-compressor and `pdserve quantize` write), integer
weights with one scale per output channel or per group of input columns:
    W8A8   int8 weights per channel, int8 activations quantized per token at run time ("int-quantized")
    W8A16  int8 weights per channel, activations in the model's dtype ("pack-quantized", as llm-compressor
           writes it: four to an int32; "int-quantized" read too)
    W4A16  int4 weights per group of 32/64/128 input columns, symmetric or with zero points ("pack-quantized")
Anything else (FP8, NVFP4, GPTQ's and AWQ's own layouts, static activation scales, a quantized KV cache) is a
clear refusal naming the scheme and these. The kernels that run them: llm_engine/quantized_linear.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED = ("compressed-tensors W8A8 (int8 weights per channel, dynamic per-token int8 activations), W8A16 "
             "(int8 weights per channel) and W4A16 (int4 weights per group of 32, 64 or 128 columns, "
             "symmetric or asymmetric)")
# vLLM's -q names that a checkpoint of the supported kinds answers to.
QUANTIZATION_FLAG_NAMES = ("compressed-tensors",)
GROUP_SIZES = (32, 64, 128)
# What `pdserve quantize` writes (llm-compressor's preset names; llm_engine/checkpoint_quantizer.py).
QUANTIZE_SCHEMES = ("W8A8", "W8A16", "W4A16", "W4A16_ASYM")
# The checkpoints' own layer names (transformers' module names) of the seven linears the engine fuses.
LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class UnsupportedQuantization(ValueError):
    """A checkpoint quantized in a way pdserve does not serve; the message names the scheme and what is."""


@dataclass(frozen=True)
class LayerQuant:
    """How one linear layer's weight is stored and run."""

    weight_bits: int  # 8 or 4
    group_size: int | None  # None: one scale per output channel
    symmetric: bool  # False: per-group zero points (W4A16 asymmetric)
    dynamic_int8_activations: bool  # W8A8: activations quantized per token at run time
    packed: bool = False  # stored packed into int32 words ("pack-quantized"), else one int8 each

    @property
    def label(self) -> str:
        """"w8a8", "w8a16", "w4a16-g64", "w4a16-g128-asym"."""
        name = f"w{self.weight_bits}a{8 if self.dynamic_int8_activations else 16}"
        if self.group_size is not None:
            name += f"-g{self.group_size}"
        return name if self.symmetric else name + "-asym"


@dataclass(frozen=True)
class _Group:
    targets: tuple[str, ...]  # "Linear", a module name, or "re:<regex>" over module names
    quant: LayerQuant


@dataclass(frozen=True)
class WeightScheme:
    """A compressed-tensors checkpoint's quantization, layer by layer."""

    groups: tuple[_Group, ...]
    ignore: tuple[str, ...]  # module names or "re:" patterns kept unquantized (lm_head, as a rule)

    def layer(self, name: str) -> LayerQuant | None:
        """The quantization of linear layer `name` ("model.layers.3.mlp.up_proj"), None: unquantized."""
        if any(_matches(pattern, name) for pattern in self.ignore):
            return None
        for group in self.groups:
            if any(target == "Linear" or _matches(target, name) for target in group.targets):
                return group.quant
        return None

    @property
    def label(self) -> str:
        """What /admin/pools and the metrics show: the decoder layers' scheme(s), "w8a8" or "w4a16-g64"."""
        labels = {quant.label if (quant := self.layer(f"model.layers.0.{suffix}")) else "unquantized"
                  for suffix in LINEAR_SUFFIXES}
        return "+".join(sorted(labels))


def _matches(pattern: str, name: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None  # as compressed-tensors matches them
    return name == pattern or name.endswith("." + pattern)


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"the checkpoint's quantization ({what}) is not supported; pdserve serves "
                                   f"{SUPPORTED}")


def _layer_quant(name: str, group: dict[str, Any], packed: bool) -> LayerQuant:
    weights = group.get("weights") or {}
    activations = group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(f"group {name}: quantized output activations")
    if weights.get("type", "int") != "int":
        raise _refuse(f"group {name}: {weights.get('type')} weights of {weights.get('num_bits')} bits")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if weights.get("dynamic") or weights.get("actorder") not in (None, "static", False):
        raise _refuse(f"group {name}: weights with actorder {weights.get('actorder')!r}")
    group_size = weights.get("group_size")
    if bits == 8 and strategy == "channel" and weights.get("symmetric", True):
        size = None
    elif bits == 4 and strategy == "group" and group_size in GROUP_SIZES:
        size = int(group_size)
    else:
        kind = "symmetric" if weights.get("symmetric", True) else "asymmetric"
        raise _refuse(f"group {name}: {bits}-bit {kind} weights by {strategy}"
                      + (f" of {group_size}" if group_size else ""))
    dynamic = False
    if activations:
        if not (activations.get("type", "int") == "int" and activations.get("num_bits") == 8
                and activations.get("strategy") == "token" and activations.get("dynamic")
                and activations.get("symmetric", True) and bits == 8):
            raise _refuse(f"group {name}: {activations.get('num_bits')}-bit {activations.get('type')} "
                          f"activations by {activations.get('strategy')}"
                          f"{', dynamic' if activations.get('dynamic') else ', static'}"
                          f" with {bits}-bit weights")
        dynamic = True
    return LayerQuant(int(bits), size, bool(weights.get("symmetric", True)), dynamic, packed)


def read_weight_scheme(raw: dict[str, Any]) -> WeightScheme | None:
    """config.json's quantization, or None for an unquantized checkpoint.

    Raises:
        UnsupportedQuantization: a method, format or scheme pdserve does not serve (the message names it and
            the supported ones).
    """
    config = raw.get("quantization_config") or raw.get("compression_config")
    if not config:
        return None
    method = config.get("quant_method")
    if method != "compressed-tensors":
        bits = config.get("bits") or config.get("w_bit")
        raise _refuse(f"quant_method {method!r}" + (f", {bits}-bit" if bits else ""))
    if config.get("kv_cache_scheme"):
        raise _refuse("a quantized KV cache (kv_cache_scheme)")
    sparsity = config.get("sparsity_config") or {}
    if sparsity.get("format") not in (None, "dense"):
        raise _refuse(f"sparsity format {sparsity.get('format')!r}")
    groups = []
    for name, group in (config.get("config_groups") or {}).items():
        fmt = group.get("format") or config.get("format")
        if fmt not in ("int-quantized", "pack-quantized"):
            raise _refuse(f"format {fmt!r}")
        quant = _layer_quant(name, group, fmt == "pack-quantized")
        if quant.weight_bits == 4 and not quant.packed:
            raise _refuse(f"group {name}: int4 weights stored as {fmt}")
        groups.append(_Group(tuple(group.get("targets") or ()), quant))
    if not groups:
        raise _refuse("no config_groups")
    return WeightScheme(tuple(groups), tuple(config.get("ignore") or ()))


def read_checkpoint_scheme(model_dir: str | Path) -> WeightScheme | None:
    """read_weight_scheme of `model_dir`'s config.json."""
    return read_weight_scheme(json.loads((Path(model_dir) / "config.json").read_text()))


def check_quantization_flag(flag: str | None, scheme: WeightScheme | None) -> None:
    """vLLM's `-q/--quantization` checked against what the checkpoint holds (None: not given).

    Raises:
        UnsupportedQuantization: a method pdserve does not serve, or one the checkpoint is not in.
    """
    if flag is None:
        return
    if flag not in QUANTIZATION_FLAG_NAMES:
        raise UnsupportedQuantization(
            f"-q/--quantization {flag!r}: pdserve serves checkpoints already quantized by compressed-tensors "
            f"(-q {' or '.join(QUANTIZATION_FLAG_NAMES)}, or leave -q out: the checkpoint says): "
            f"{SUPPORTED}; `pdserve quantize` writes one from an unquantized model")
    if scheme is None:
        raise UnsupportedQuantization(
            f"-q/--quantization {flag}: the checkpoint is not quantized (its config.json has no "
            "quantization_config); quantize it first with `pdserve quantize`, or leave -q out")
