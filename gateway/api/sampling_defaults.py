"""`--generation-config`: the model's own sampling defaults, for the fields a request leaves unset (as vLLM).

    auto  (vLLM's default) the model directory's generation_config.json: its temperature, top_p, top_k,
          min_p, repetition penalty, presence/frequency penalties; its max_new_tokens is the max_tokens of a
          chat request that names none;
    vllm  the file is ignored: the neutral defaults (temperature 1, top_p 1, no top_k, no penalties);
    DIR   the generation_config.json in DIR, the same fields; its max_new_tokens also caps every request's
          max_tokens (as vLLM treats a config given by path).
The file is read as transformers reads it (GenerationConfig) and as vLLM takes it (`to_diff_dict`: the values
that differ from transformers' defaults, which since transformers 5 are unset, so every value the file gives
counts). A field a request sets, even to the neutral value, is the request's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_engine.params import SamplingParams

if TYPE_CHECKING:
    from gateway.api.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Sampling values for the fields a request leaves unset (None: the request model's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int | None = None  # max_new_tokens: a chat request's max_tokens when it names none
    max_tokens_cap: int | None = None  # --generation-config DIR: max_new_tokens caps every request

    def value(self, request: CompletionRequest | ChatCompletionRequest, name: str) -> Any:
        """The request's `name` if it set it, else this default, else the request model's default."""
        default = getattr(self, name)
        if name in request.model_fields_set or default is None:
            return getattr(request, name)
        return default

    def described(self) -> str:
        """`temperature=0.6, top_k=20, ...` of the values set (for the start-up log)."""
        return ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                         if getattr(self, f.name) is not None)


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


def check_generation_config(source: str) -> str:
    """`source` if it is auto, vllm, or a directory holding generation_config.json.

    Raises:
        ValueError: anything else (the message says what was expected).
    """
    if source in ("auto", "vllm"):
        return source
    if not (Path(source) / GENERATION_CONFIG_FILE).is_file():
        raise ValueError(f"expected auto, vllm or a directory holding {GENERATION_CONFIG_FILE}; "
                         f"{source!r} has none")
    return source


def read_sampling_defaults(source: str, model_dir: str) -> SamplingDefaults:
    """The defaults `--generation-config source` gives a model in `model_dir` (see the module docstring)."""
    if source == "vllm":
        return SamplingDefaults()
    folder = Path(model_dir if source == "auto" else source)
    if not (folder / GENERATION_CONFIG_FILE).is_file():
        return SamplingDefaults()
    from transformers import GenerationConfig

    diff = GenerationConfig.from_pretrained(folder).to_diff_dict()
    values: dict[str, Any] = {name: diff[name] for name in SAMPLING_FIELDS if diff.get(name) is not None}
    max_new_tokens = diff.get("max_new_tokens")
    if max_new_tokens is not None:
        values["max_tokens"] = int(max_new_tokens)
        if source != "auto":
            values["max_tokens_cap"] = int(max_new_tokens)
    if "top_k" in values:
        values["top_k"] = max(0, int(values["top_k"]))  # transformers' "no top_k" may be 0 or -1: pdserve's 0
    defaults = SamplingDefaults(**values)
    try:  # values a request could not send (temperature 5) stop the server at start, naming the file
        SamplingParams(**{name: getattr(defaults, name) for name in SAMPLING_FIELDS
                          if getattr(defaults, name) is not None})
    except ValueError as error:
        raise ValueError(f"{folder / GENERATION_CONFIG_FILE}: {error} (--generation-config vllm ignores the "
                         "file)") from None
    if values:
        logger.info("sampling defaults from %s: %s (requests that set a field keep theirs; "
                    "--generation-config vllm ignores the file)", folder / GENERATION_CONFIG_FILE,
                    defaults.described())
    return defaults
