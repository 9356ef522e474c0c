"""The engine both pools run: model loading, paged KV cache, paged attention, sampling, scheduling."""

from llm_engine.batch import ModelInput, ModelOutput, SampledToken, ScheduledChunk
from llm_engine.block_pool import BlockPool
from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.engine import Completion, LLMEngine, RequestOutput
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.kv_cache_manager import KVCacheManager
from llm_engine.logprobs import PromptLogprobs, TopLogprobs
from llm_engine.sampling import SamplingParams

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
