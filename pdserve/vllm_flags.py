"""vLLM's `serve` flags as a vLLM user types them: each is accepted (doing nothing here, or renamed to
pdserve's own flag), or refused with a sentence saying why and what to use instead. docs/serving.md ("Coming
from vLLM") lists the same table.

    no-op     pdserve already behaves so (prefix caching, chunked prefill, auto tool choice are always on)
              or the flag has nothing to act on: accepted, and one log line says so;
    renamed   the same setting under pdserve's name (--kv-cache-memory-bytes → --kv-cache-memory, --dtype
              half → float16, --enforce-eager → --compile off): the value moves there, and a log line says so;
    refused   something pdserve cannot do yet (pipeline parallelism, LoRA, ...): the
              command stops before anything starts, naming the flag.
Flags vLLM and pdserve share (--max-model-len, -tp/--tensor-parallel-size, --max-num-seqs,
--gpu-memory-utilization, ..., and the HTTP
server's: --uvicorn-log-level, --ssl-*, --root-path, --allowed-origins, ...: gateway/http_settings.py) are
pdserve's own (gateway/config.py) and need nothing here.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("pdserve.serve")

NO_PP = ("a worker splits its model over ranks by heads (--tensor-parallel-size), not by layers (no pipeline "
         "parallelism): use -tp N, or add workers for throughput (--prefill N --decode M)")


@dataclass(frozen=True)
class Outcome:
    """What one given vLLM flag becomes: a log line, and pdserve settings it sets (field → value)."""

    note: str
    settings: dict[str, Any]


class RefusedFlag(ValueError):
    """A vLLM flag pdserve cannot honour; the message names it, says why and what to use instead."""


Translate = Callable[[Any, dict[str, Any]], Outcome]  # (the flag's value, the pdserve flags given) → outcome


@dataclass(frozen=True)
class VllmFlag:
    names: tuple[str, ...]  # as vLLM spells them (short form first); messages name them all
    help: str  # shown under "vLLM's flags" in `pdserve serve --help`
    translate: Translate
    takes_value: bool = True  # False: a switch (argparse store_true)
    is_bool_pair: bool = False  # vLLM's --x/--no-x (argparse BooleanOptionalAction)
    takes_many: bool = False  # several values (vLLM's nargs="+"), so that the refusal names this flag

    @property
    def dest(self) -> str:
        return "vllm_" + self.names[-1].lstrip("-").replace("-", "_")


def no_op(why: str) -> Translate:
    return lambda value, flags: Outcome(f"accepted, no effect: {why}", {})


def refused(why: str) -> Translate:
    def translate(value: Any, flags: dict[str, Any]) -> Outcome:
        raise RefusedFlag(why)
    return translate


def only_one(why: str) -> Translate:
    """-tp 1 (and the like) is what pdserve does; more is refused."""
    def translate(value: Any, flags: dict[str, Any]) -> Outcome:
        if int(value) == 1:
            return Outcome("accepted, no effect: 1 is what pdserve does", {})
        raise RefusedFlag(why)
    return translate


def prefix_caching(value: bool, flags: dict[str, Any]) -> Outcome:
    if not value:
        raise RefusedFlag("pdserve's prefix cache is always on (the router places each prompt by what every "
                          "worker has cached); it changes no output. For benchmarks without cache hits, send "
                          "prompts that share no prefix")
    return Outcome("accepted, no effect: the prefix cache is always on", {})


def chunked_prefill(value: bool, flags: dict[str, Any]) -> Outcome:
    if not value:
        return Outcome("accepted, no effect: prompts are still cut into chunks of --max-num-batched-tokens; "
                       "give --max-num-batched-tokens at least --max-model-len to prefill each prompt in one "
                       "step", {})
    return Outcome("accepted, no effect: chunked prefill is always on (--max-num-batched-tokens a step)", {})


# vLLM's human-readable integers: k/m/g/t are powers of 1000, K/M/G/T of 1024 (pdserve's own --kv-cache-memory
# reads both as 1024, so the value is passed on as a number of bytes).
_HUMAN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgtKMGT]?)\s*$")


def vllm_bytes(text: str) -> int:
    """A vLLM --kv-cache-memory-bytes value in bytes ("2G" = 2 × 1024³, "2g" = 2 × 10⁹)."""
    match = _HUMAN.match(str(text))
    if match is None:
        raise RefusedFlag(f"expected a number of bytes such as 4294967296, 4G (1024³) or 4g (10⁹), "
                          f"got {text!r}")
    number, unit = float(match.group(1)), match.group(2)
    if not unit:
        return int(number)
    power = "kmgt".index(unit.lower()) + 1
    return int(number * (1024 if unit.isupper() else 1000) ** power)


def kv_cache_memory_bytes(value: str, flags: dict[str, Any]) -> Outcome:
    num_bytes = vllm_bytes(value)
    return Outcome(f"renamed: --kv-cache-memory {num_bytes} (bytes)", {"kv_cache_memory": num_bytes})


def enforce_eager(value: bool, flags: dict[str, Any]) -> Outcome:
    return Outcome("renamed: --compile off (the model body runs eager, not as a compiled graph)",
                   {"compile": "off"})


def tokenizer(value: str, flags: dict[str, Any]) -> Outcome:
    if value == flags.get("model"):
        return Outcome("accepted, no effect: the model's own tokenizer", {})
    raise RefusedFlag("pdserve uses the tokenizer of the model it serves; to change only the chat template, "
                      "give --chat-template")


def load_format(value: str, flags: dict[str, Any]) -> Outcome:
    if value in ("auto", "safetensors"):
        return Outcome("accepted, no effect: weights are read from *.safetensors", {})
    raise RefusedFlag("pdserve reads safetensors weights only (auto, safetensors)")


def generation_only(value: str, flags: dict[str, Any]) -> Outcome:
    if value in ("auto", "generate"):
        return Outcome("accepted, no effect: pdserve serves text generation", {})
    raise RefusedFlag("pdserve serves text generation only (no embeddings, scoring or classification)")


FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--enable-prefix-caching",), "always on (--no-enable-prefix-caching is refused)",
             prefix_caching, is_bool_pair=True),
    VllmFlag(("--enable-chunked-prefill",), "always on: chunks of --max-num-batched-tokens", chunked_prefill,
             is_bool_pair=True),
    VllmFlag(("--enable-auto-tool-choice",), "always on: tool calls are parsed whenever tools are given",
             no_op("tool calls are parsed whenever a request gives tools (--tool-call-parser)"),
             takes_value=False),
    VllmFlag(("--kv-cache-memory-bytes",), "→ --kv-cache-memory (k = 1000, K = 1024, as vLLM)",
             kv_cache_memory_bytes),
    VllmFlag(("--enforce-eager",), "→ --compile off", enforce_eager, takes_value=False),
    VllmFlag(("-pp", "--pipeline-parallel-size"), "1 only (no pipeline parallelism yet)", only_one(NO_PP)),
    VllmFlag(("-dp", "--data-parallel-size"), "1 only: pdserve's workers are its data parallelism",
             only_one("pdserve's workers are its data parallelism: give the number of each kind, "
                      "--prefill N --decode M (or --mixed K for colocated workers)")),
    VllmFlag(("--distributed-executor-backend",), "accepted: workers are always Ray actors",
             no_op("the workers are always Ray actors (--address joins a cluster)")),
    VllmFlag(("--trust-remote-code",), "accepted: no model code is loaded",
             no_op("pdserve runs its own code for the architectures it supports, never a model's"),
             takes_value=False),
    VllmFlag(("--disable-log-requests",), "accepted: requests are not logged",
             no_op("pdserve does not log requests"), takes_value=False),
    VllmFlag(("--disable-log-stats",), "accepted: there is no periodic stats line",
             no_op("pdserve prints no periodic stats (see /metrics)"), takes_value=False),
    VllmFlag(("--tokenizer",), "the model's own only", tokenizer),
    VllmFlag(("--load-format",), "auto or safetensors only", load_format),
    VllmFlag(("--runner",), "generate only", generation_only),
    VllmFlag(("--task",), "generate only (vLLM's older spelling of --runner)", generation_only),
    VllmFlag(("--enable-log-requests",), "accepted: request contents are not logged",
             no_op("pdserve does not log request contents (the access log and X-Request-Id remain)"),
             takes_value=False),
    VllmFlag(("--enable-sleep-mode",), "refused: no sleep mode", refused(
        "there is no sleep mode: scale a pool down with PUT /admin/pools instead"), takes_value=False),
    VllmFlag(("--swap-space",), "accepted: a preempted request is recomputed",
             no_op("a preempted request is recomputed, never swapped to CPU memory")),
    VllmFlag(("--lora-modules",), "refused: no LoRA adapters", refused(
        "LoRA adapters are not served: merge the adapter into the model (peft's merge_and_unload) and serve "
        "the merged model"), takes_many=True),
    VllmFlag(("--enable-lora",), "refused: no LoRA adapters", refused(
        "LoRA adapters are not served: merge the adapter into the model (peft's merge_and_unload) and serve "
        "the merged model"), takes_value=False),
    VllmFlag(("--speculative-config",), "refused: no speculative decoding", refused(
        "speculative decoding is not implemented: leave the flag out")),
    VllmFlag(("--kv-transfer-config",), "refused: pdserve moves KV itself", refused(
        "pdserve moves the KV cache between its own prefill and decode workers: choose the layout with "
        "--prefill/--decode and the transport with --backend (nixl, torch, local)")),
    VllmFlag(("--cpu-offload-gb",), "refused: weights stay on the device", refused(
        "weights are not offloaded: each worker holds the whole model on its device")),
)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Each of FLAGS on `parser`, in a group of their own in the help."""
    group = parser.add_argument_group(
        "vLLM's flags", "accepted as vLLM users type them: a no-op, renamed to pdserve's flag, or refused "
                        "with the reason (docs/serving.md, \"Coming from vLLM\")")
    for flag in FLAGS:
        options: dict[str, Any] = {"dest": flag.dest, "default": None, "help": flag.help}
        if flag.is_bool_pair:
            options["action"] = argparse.BooleanOptionalAction
        elif not flag.takes_value:
            options["action"] = "store_const"
            options["const"] = True
        else:
            options["metavar"] = "VALUE"
            if flag.takes_many:
                options["nargs"] = "+"
        group.add_argument(*flag.names, **options)


def translate_vllm_flags(args: argparse.Namespace, flags: dict[str, Any]) -> dict[str, Any]:
    """`flags` (pdserve's, as given) with what the vLLM flags given in `args` become; each logged.

    Raises:
        RefusedFlag: a flag pdserve cannot honour, or a renamed flag that clashes with pdserve's own.
    """
    flags = dict(flags)
    for flag in FLAGS:
        value = getattr(args, flag.dest, None)
        if value is None:
            continue
        name = "/".join(flag.names)  # -tp/--tensor-parallel-size: named as the user may have typed it
        given = " ".join(map(str, value)) if isinstance(value, list) else value
        shown = name if value is True else (
            f"--no-{flag.names[0][2:]}" if value is False else f"{name} {given}")
        try:
            outcome = flag.translate(value, flags)
        except (RefusedFlag, ValueError) as error:
            raise RefusedFlag(f"{shown}: {error}") from None
        for field, setting in outcome.settings.items():
            if field in flags and flags[field] != setting:
                pdserve_flag = "--" + field.replace("_", "-")
                raise RefusedFlag(f"{shown}: clashes with {pdserve_flag} {flags[field]}; give one")
        flags.update(outcome.settings)
        logger.info("%s: %s", shown, outcome.note)
    if flags.get("dtype") in ("half", "float"):
        flags["dtype"] = _dtype_spelling(flags["dtype"], flags.get("device"))
    return flags


def _dtype_spelling(dtype: str, device: str | None) -> str:
    """vLLM's --dtype half / float as pdserve's dtype. pdserve's CPU kernels do not run float16: there `half`
    becomes auto, the CPU's native 16-bit type (bfloat16) where it has one, else float32."""
    if dtype == "float":
        logger.info("--dtype float: renamed: --dtype float32")
        return "float32"
    from llm_engine.hardware import resolve_device

    resolved = resolve_device(device or os.environ.get("PDSERVE_DEVICE") or "auto")
    if resolved.startswith("cuda"):
        logger.info("--dtype half: renamed: --dtype float16")
        return "float16"
    logger.info("--dtype half: on a CPU pdserve does not run float16: --dtype auto (bfloat16 where the CPU "
                "computes it natively, else float32)")
    return "auto"


def unknown_flag_message(command: str, unknown: list[str]) -> str:
    """argparse's "unrecognized arguments", said so that a user knows where to look."""
    return (f"{unknown[0]}: `pdserve {command}` has no such flag or argument (`pdserve {command} --help` "
            "lists them; vLLM's flags and what pdserve does with each: docs/serving.md, \"Coming from "
            "vLLM\")")
