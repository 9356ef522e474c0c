"""What the gateway does before it serves: find the model's config and tokenizer here (resolve_model_dir),
then say what it serves (announce; each worker's KV capacity is the fleet's to say: gateway/fleet/
bring_up_log.py announce_kv)."""

from __future__ import annotations

import time

from fastapi import FastAPI

from gateway.config import ServeConfig
from gateway.serve_settings import base_url
from llm_engine.model_files import ModelNotFoundError, read_model_spec, resolve_model
from llm_engine.weight_schemes import check_quantization_flag, read_checkpoint_scheme
from worker_runtime.process_heap import freeze_startup_heap


def resolve_model_dir(config: ServeConfig) -> str:
    """The gateway's own copy of the model's config and tokenizer: a directory as given, a Hugging Face id
    through this machine's cache (each worker resolves the weights on its node: ModelSource).

    Raises:
        ModelNotFoundError: the id cannot be resolved here; the message names --model.
        ValueError: the model's architecture is not one the engine serves; the message names --model.
    """
    if config.model is None:
        from llm_engine.default_model import prepare_default_model

        check_quantization_flag(config.quantization, None)  # the default model is not quantized
        return str(prepare_default_model())
    try:
        model_dir = str(resolve_model(config.model, config.revision, weights=False))
    except ModelNotFoundError as error:
        raise ModelNotFoundError(f"--model {error}") from None
    try:
        spec = read_model_spec(model_dir)  # here, not in every worker's traceback
        check_quantization_flag(config.quantization, read_checkpoint_scheme(model_dir))
    except ValueError as error:
        raise ValueError(f"--model {config.model}: {error}") from None
    spec.with_max_model_len(config.max_model_len)  # a --max-model-len beyond the context: refused here too
    return model_dir


def announce(app: FastAPI, config: ServeConfig, backend: str, frontends: str = "") -> None:
    freeze_startup_heap()  # a full collection over the imported libraries would stall every stream
    app.state.started = time.time()
    layout = (f"{config.prefill or 0} prefill + {config.decode or 0} decode + {config.mixed or 0} "
              f"mixed workers (KV transfer: {backend}; ratio {config.ratio})")
    print(f"pdserve: serving {app.state.service.model_name} on {base_url(config)} with {layout}{frontends}",
          flush=True)
