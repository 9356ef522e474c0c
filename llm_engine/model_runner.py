"""Runs one forward of a packed, mixed prefill/decode batch over the paged KV cache and samples.

    execute(ModelInput) → ModelOutput:
        pack new tokens [1, T] and positions → build attention metadata → model body
        → lm_head on the rows that sample only → sample.
Owns the KV cache tensor; knows nothing of scheduling, queues or Ray.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llm_engine.batch import ModelInput, ModelOutput, SampledToken
from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.paged_attention import build_metadata
from llm_engine.sampling import sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ModelRunner:
    def __init__(
        self, model: PreTrainedModel, spec: ModelSpec, config: EngineConfig, num_blocks: int | None = None
    ) -> None:
        self.model = model
        self.spec = spec
        self.config = config
        self.device = torch.device(config.device)
        self.cache_spec = KVCacheSpec.from_model(spec, config)
        self.num_blocks = num_blocks or self.cache_spec.num_blocks_for(config.kv_cache_bytes)
        # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = self.cache_spec.allocate(self.num_blocks, self.device)

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> ModelOutput:
        """Compute every chunk's new tokens and sample for the chunks that ask for it."""
        if not batch.chunks:
            return ModelOutput(())
        token_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in batch.chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.context_len))
            if chunk.sampling is not None:
                sample_rows.append(len(token_ids) - 1)
        input_ids = torch.tensor([token_ids], device=self.device)  # [1, T]
        position_ids = torch.tensor([positions], device=self.device)  # [1, T]
        metadata = build_metadata(batch.chunks, self.kv_cache)
        hidden = self.model.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, paged_metadata=metadata
        ).last_hidden_state  # [1, T, hidden]
        if not sample_rows:
            return ModelOutput(())
        # Project only the rows that sample: the vocab projection of every prompt token is wasted work.
        logits = self.model.lm_head(hidden[0, sample_rows])  # [num_samples, vocab]
        sampling_chunks = [c for c in batch.chunks if c.sampling is not None]
        chosen, logprobs = sample(
            logits,
            [c.sampling for c in sampling_chunks if c.sampling is not None],
            [c.output_index for c in sampling_chunks],
        )
        return ModelOutput(
            tuple(
                SampledToken(c.request_id, token, None if logprobs is None or not c.sampling.logprobs
                             else logprobs[i])
                for i, (c, token) in enumerate(zip(sampling_chunks, chosen, strict=True))
                if c.sampling is not None
            )
        )
