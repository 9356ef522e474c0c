"""Where a model's files are on this machine: a local directory as named, or a Hugging Face model id
(`org/name`) resolved through huggingface_hub, as vLLM users expect.

huggingface_hub does the hub's part its own way, read from the environment: its cache (`HF_HOME`,
`HF_HUB_CACHE`), `HF_HUB_OFFLINE=1` (the cache only, no network), the token (`HF_TOKEN`, or `hf auth login`'s
file) for private and gated models, and `HF_ENDPOINT`. Only what the engine reads is fetched: the config and
tokenizer files, and with `weights=True` the top-level safetensors.

Each process resolves the id for itself: the gateway for the tokenizer and chat template (`weights=False`),
each worker on its own node for the weights (worker_runtime/model_source.py), so the nodes of a cluster
need no shared disk: each fills its own cache, or finds it filled.

What a model directory says, read without torch (the gateway reads it): its shape (read_model_spec) and its
tokenizer (load_tokenizer).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from llm_engine.checkpoint_config import LeanConfig, read_lean_config
from llm_engine.config import SUPPORTED_ARCHITECTURES, ModelSpec
from llm_engine.weight_schemes import UnsupportedQuantization, read_weight_scheme

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

# Top-level files transformers reads for the config, the tokenizer and the chat template.
CONFIG_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
    "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken",
    "chat_template.json", "chat_template.jinja",
)
WEIGHT_FILES = ("*.safetensors", "model.safetensors.index.json")  # the loader reads safetensors only
# transformers loads the top level only; subfolders hold other formats or variants (original/, onnx/, gguf/).
_SKIPPED = ("*/*",)


class ModelNotFoundError(FileNotFoundError):
    """The model names no local directory and no Hugging Face model this machine can get."""


def is_local_path(model: str) -> bool:
    """True when `model` names something on disk (then it is a directory or an error, never a hub id)."""
    return Path(model).expanduser().exists()


def check_model_name(model: str) -> None:
    """Check the form of a --model value without touching the network.

    Raises:
        ValueError: it is an existing file (not a directory), or neither an existing path nor an id.
    """
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{model!r} is a file, not a model directory")
        return
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        raise ValueError(f"{model!r} does not exist as a directory and is not a Hugging Face model id "
                         "(org/name)") from None


def served_name(model: str | None, model_dir: str | Path) -> str:
    """The name clients send by default: a hub id as given (as vLLM does), else the directory's name."""
    if model is not None and not is_local_path(model):
        return model
    return Path(model_dir).name


def resolve_model(model: str, revision: str | None = None, *, weights: bool) -> Path:
    """The local directory holding `model`'s files, downloading into the Hugging Face cache what is missing.

    Args:
        model: a local directory, or a Hugging Face model id.
        revision: a branch, tag or commit of the hub model (None: its default branch); not for a directory.
        weights: fetch the safetensors too (a worker), not only config and tokenizer (the gateway).

    Raises:
        ModelNotFoundError: the id is unknown, private or gated without a token, not cached while offline,
            or its files are not what the engine loads; the message says which and what to do.
    """
    if is_local_path(model):
        if revision is not None:
            raise ModelNotFoundError(f"{model!r} is a local directory: a revision applies to a hub model id")
        return Path(model).expanduser()
    return _resolve_hub_id(model, revision, weights)


@functools.lru_cache(maxsize=16)  # the gateway checks at start and resolves again in its lifespan
def _resolve_hub_id(model: str, revision: str | None, weights: bool) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    named = model if revision is None else f"{model} (revision {revision})"
    patterns = list(CONFIG_FILES + (WEIGHT_FILES if weights else ()))
    try:
        path = Path(snapshot_download(model, revision=revision, allow_patterns=patterns,
                                      ignore_patterns=list(_SKIPPED)))
    except GatedRepoError:
        raise ModelNotFoundError(f"{named} is gated: accept its terms on huggingface.co and set HF_TOKEN to "
                                 "a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{named}: no such model on the Hugging Face Hub (or it is private: set "
                                 "HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{model} has no revision {revision!r} on the Hugging Face Hub") from None
    except LocalEntryNotFoundError as error:  # also a cached copy that misses files
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFoundError(
                f"{named} is not (wholly) in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                "HF_HUB_OFFLINE is set: download it once with network access (`hf download MODEL`), point "
                "HF_HOME at a cache that has it, or give a local directory") from None
        raise ModelNotFoundError(
            f"{named} is not (wholly) cached and the Hugging Face Hub cannot be reached: check the network "
            f"(or HF_ENDPOINT), or give a local directory ({str(error).splitlines()[-1]})") from None
    except HfHubHTTPError as error:
        raise ModelNotFoundError(f"{named}: the Hugging Face Hub answered {error}") from None
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{named} has no config.json: not a transformers model")
    if weights and not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{named} has no *.safetensors weights at its top level in {path} (pdserve "
                                 "loads safetensors only; offline, the cache must hold the whole model)")
    return path


def read_model_spec(model_dir: str | Path) -> ModelSpec:
    """Read and check a model directory's config.json without loading weights.

    Raises:
        FileNotFoundError: the directory or its config.json does not exist.
        ValueError: the architecture is not one the engine supports, or its quantization
            (UnsupportedQuantization: the message names the scheme and the supported ones).
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
    eos = raw.get("eos_token_id")
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    scheme = read_weight_scheme(raw)
    lean = read_lean_config(path)
    if scheme is not None and not isinstance(lean, LeanConfig):
        raise UnsupportedQuantization(
            f"{str(path)!r}: quantized weights are served by the engine's own body, and this checkpoint "
            f"needs transformers' reading ({lean})")
    if isinstance(lean, LeanConfig):  # plain rope: the context is the model's; a window caps it
        window = lean.sliding_window
        return ModelSpec(
            architecture=lean.architecture, num_layers=lean.num_layers, num_heads=lean.num_heads,
            num_kv_heads=lean.num_kv_heads, head_dim=lean.head_dim, hidden_size=lean.hidden_size,
            intermediate_size=lean.intermediate_size, vocab_size=lean.vocab_size,
            max_model_len=min(lean.max_position_embeddings, window or lean.max_position_embeddings),
            eos_token_ids=eos_ids, weights=scheme.label if scheme is not None else "unquantized",
        )
    return _spec_from_transformers(path, supported[0], eos_ids)


def _spec_from_transformers(path: Path, architecture: str, eos_ids: tuple[int, ...]) -> ModelSpec:
    """transformers' own reading of the config: its class fills the family's defaults (Mistral's window
    when the file names none, Qwen's use_sliding_window), exactly as the model it loads will see them."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    num_heads = config.num_attention_heads
    max_model_len = min(config.max_position_embeddings, _static_rope_limit(config))
    # The paged attention is full attention; a sliding window only changes results past the window, so cap
    # the context there rather than serve wrong tokens (paged_attention.py checks it on every forward).
    window = getattr(config, "sliding_window", None)
    if window:
        max_model_len = min(max_model_len, window)
    return ModelSpec(
        architecture=architecture,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        hidden_size=config.hidden_size,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        eos_token_ids=eos_ids,
    )


def _static_rope_limit(config: PretrainedConfig) -> int:
    """The longest context over which the rotary frequencies stay fixed. "dynamic" and "longrope" scaling
    switch frequencies by the longest position in the forward, and a packed batch mixes requests: past the
    original length one request's length would change another's tokens, so the context stops there."""
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type") in ("dynamic", "longrope"):
        original = rope.get("original_max_position_embeddings")
        return int(original or getattr(config, "original_max_position_embeddings", None)
                   or config.max_position_embeddings)
    return int(config.max_position_embeddings)


def load_tokenizer(model_dir: str | Path, class_name: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer: AutoTokenizer's choice, or `class_name` (tokenizer_class_name's answer in a
    process that has torch) loaded as it is: AutoTokenizer picks the class by the model's config, which
    transformers reads through a module that imports torch; the class itself loads without it (a frontend
    holds no torch). A class transformers does not export (a model's own code) goes through AutoTokenizer."""
    import transformers

    read_model_spec(model_dir)
    named = getattr(transformers, class_name, None) if class_name is not None else None
    if named is None:
        return transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tokenizer: PreTrainedTokenizerBase = named.from_pretrained(str(model_dir))
    return tokenizer


def tokenizer_class_name(model_dir: str | Path) -> str:
    """The name of the tokenizer class AutoTokenizer loads for the model (load_tokenizer's `class_name`)."""
    return type(load_tokenizer(model_dir)).__name__
