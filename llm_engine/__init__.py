"""The engine both pools run: model loading, paged KV cache, paged attention, sampling, scheduling.

The package's public names load on first use (PEP 562), so that importing a torch-free submodule
(llm_engine.params, llm_engine.finish_reason: what the gateway and the stages' messages read) does not
load the engine and torch with this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llm_engine.batch import ModelInput, ModelOutput, SampledToken, ScheduledChunk
    from llm_engine.block_pool import BlockPool
    from llm_engine.config import EngineConfig, ModelSpec
    from llm_engine.engine import Completion, LLMEngine, RequestOutput
    from llm_engine.kv_cache import KVCacheSpec
    from llm_engine.kv_cache_manager import KVCacheManager
    from llm_engine.params import PromptLogprobs, SamplingParams, TopLogprobs

_HOMES = {
    "BlockPool": "block_pool",
    "Completion": "engine",
    "EngineConfig": "config",
    "KVCacheManager": "kv_cache_manager",
    "KVCacheSpec": "kv_cache",
    "LLMEngine": "engine",
    "ModelInput": "batch",
    "ModelOutput": "batch",
    "ModelSpec": "config",
    "PromptLogprobs": "params",
    "RequestOutput": "engine",
    "SampledToken": "batch",
    "SamplingParams": "params",
    "ScheduledChunk": "batch",
    "TopLogprobs": "params",
}
__all__ = [
    "BlockPool",
    "Completion",
    "EngineConfig",
    "KVCacheManager",
    "KVCacheSpec",
    "LLMEngine",
    "ModelInput",
    "ModelOutput",
    "ModelSpec",
    "PromptLogprobs",
    "RequestOutput",
    "SampledToken",
    "SamplingParams",
    "ScheduledChunk",
    "TopLogprobs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'llm_engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"llm_engine.{_HOMES[name]}"), name)
    globals()[name] = value  # once: later look-ups do not come here
    return value
