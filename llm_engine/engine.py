"""LLMEngine: one worker's model, KV cache and scheduler behind a small synchronous API.

    add_request → [step() = forward_step(): schedule → execute → update]* → RequestOutput per new token
    → finished.
No Ray and no threads here: a worker (prefill_pool, decode_pool) runs forward_step() from its step loop, with
its own queues around it; step() is the same forward for a caller with none (generate(), tests).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from llm_engine.batch import ModelInput
from llm_engine.block_pool import BlockPool
from llm_engine.compilation import CompileReport
from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.finish_reason import FinishReason
from llm_engine.hardware import device_memory
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.kv_cache_manager import KVCacheManager, blocks_for
from llm_engine.kv_sizing import KVCapacity, plan_kv_cache
from llm_engine.model_loader import LoadedModel, load_model
from llm_engine.model_runner import ModelRunner
from llm_engine.node_locks import node_memory_lock
from llm_engine.params import PromptLogprobs, SamplingParams, TopLogprobs
from llm_engine.request import Request
from llm_engine.scheduler import Scheduler
from llm_engine.step_timeline import StepRecord
from llm_engine.tensor_parallel import (
    RankCall,
    RankCallFailed,
    StartFollowers,
    StepMirror,
    Stop,
    TPGroup,
)

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class RequestOutput:
    """One step's news about one request."""

    request_id: str
    new_token_ids: tuple[int, ...]  # tokens gained this step
    new_logprobs: tuple[float, ...]  # their log-probabilities, when asked for
    finish_reason: FinishReason | None  # None while running; STOP, LENGTH or ABORT when finished
    new_top_logprobs: tuple[TopLogprobs, ...] = ()  # per new token, when sampling.top_logprobs > 0
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when sampling.prompt_logprobs

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class ForwardStep:
    """What one forward did (LLMEngine.forward_step())."""

    batch: ModelInput  # what was computed
    advanced: list[Request]  # the requests that gained a token (finished ones included)
    record: StepRecord | None  # its timing and token counts (the runner's timeline)
    finished_at: float  # time.time() when the forward returned


@dataclass(frozen=True)
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    num_preemptions: int  # times the request lost its blocks and recomputed them
    output_top_logprobs: tuple[TopLogprobs, ...] = ()
    prompt_logprobs: PromptLogprobs | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 scheduler_cls: type[Scheduler] = Scheduler, watermark: float = 0.0,
                 tp_group: TPGroup | None = None) -> None:
        """Load the model (or adopt one load_model returned) and size the KV cache from the memory left
        (llm_engine/kv_sizing.py).

        Args:
            tp_group: rank 0's tensor-parallel group (config.tensor_parallel_size > 1): the other ranks run
                a TPFollower each, and this engine tells them the cache size and mirrors every step to them.
            scheduler_cls: the scheduler policy (a prefill worker keeps finished requests' blocks).
            watermark: fraction of blocks kept free when admitting waiting requests.
        """
        loaded = loaded or load_model(config, tp_group)
        self.config = config
        self.spec: ModelSpec = loaded.spec.with_max_model_len(config.max_model_len)  # as load_model's
        self.linear_kernel = loaded.linear_kernel
        # Measured after the weights are in memory: on CUDA they count against gpu_memory_utilization. Under
        # the node's lock until the cache is allocated, so that workers starting together do not share
        # the same free memory.
        with node_memory_lock(config.device):
            self.kv_capacity: KVCapacity = plan_kv_cache(config, self.spec, device_memory(config.device))
            kv_cache = KVCacheSpec.from_model(self.spec, config).allocate(self.kv_capacity.num_blocks,
                                                                          config.device)
        logger.info("%s", self.kv_capacity.describe())
        self.mirror = StepMirror(tp_group) if tp_group is not None and tp_group.size > 1 else None
        self._staging: torch.Tensor | None = None
        if self.mirror is not None:
            self.mirror.send(StartFollowers(self.kv_capacity.num_blocks))
        if self.mirror is not None and config.tp_staging:
            # Whole-head blocks for the KV that leaves or arrives: the same ids as the ranks' caches.
            with node_memory_lock(config.device):
                rank_spec = KVCacheSpec.from_model(self.spec, config)
                whole = replace(rank_spec, num_kv_heads=self.spec.num_kv_heads)
                self._staging = whole.allocate(self.kv_capacity.num_blocks, config.device)
        self.runner = ModelRunner(loaded.model, self.spec, config, self.kv_capacity.num_blocks, loaded.body,
                                  kv_cache, self.mirror, loaded.compilation)
        self.block_pool = BlockPool(self.runner.num_blocks)
        self.kv = KVCacheManager(self.block_pool, config.block_size, config.enable_prefix_caching)
        self.scheduler = self._make_scheduler(scheduler_cls, watermark)
        self._ids = itertools.count()

    @property
    def compilation(self) -> CompileReport:
        """How the model body runs now: compiled, eager, or compiling beside serving (the runner's)."""
        return self.runner.compilation

    @property
    def kv_block_bytes(self) -> int:
        """KV bytes of one block over every rank (all the heads): what a handoff of a block moves."""
        return replace(self.runner.cache_spec, num_kv_heads=self.spec.num_kv_heads).block_bytes

    @property
    def stages_kv(self) -> bool:
        """Rank 0 of several with a staging cache: blocks that leave or arrive go through export_blocks /
        import_blocks."""
        return self._staging is not None

    @property
    def rank_call(self) -> Callable[..., list[object]] | None:
        """Rank 0 of several without a staging cache: what the transfer layer runs on the other ranks
        (call_ranks); None otherwise."""
        return self.call_ranks if self.mirror is not None and self._staging is None else None

    def call_ranks(self, op: object, meanwhile: Callable[[], object] | None = None) -> list[object]:
        """Run `op` on every other rank (their runner's rank_handler: the transfer layer's, installed by the
        worker) and return each one's answer, in rank order; `meanwhile` runs here while they work.

        Raises:
            RuntimeError: a rank's handler raised (its error named).
        """
        assert self.mirror is not None
        with self.mirror.lock:
            self.mirror.send(RankCall(op))
            if meanwhile is not None:
                meanwhile()
            answers = self.mirror.group.gather_objects(None)[1:]
        for rank, answer in enumerate(answers, start=1):
            if isinstance(answer, RankCallFailed):
                raise RuntimeError(f"rank {rank} failed {type(op).__name__}: {answer.error}")
        return answers

    @property
    def transfer_cache(self) -> torch.Tensor:
        """The KV tensor the transfer layer registers and moves blocks of: the runner's cache, or, for rank 0
        of a tensor-parallel worker, its whole-head staging cache (llm_engine/tensor_parallel.py)."""
        return self.runner.kv_cache if self._staging is None else self._staging

    def export_blocks(self, block_ids: Sequence[int]) -> None:
        """Make these blocks' KV whole in the transfer cache before they are offered (tensor parallel: every
        rank's heads gathered; one rank: nothing to do)."""
        if self._staging is not None and block_ids:
            self.runner.gather_blocks(tuple(block_ids), self._staging)

    def import_blocks(self, block_ids: Sequence[int]) -> None:
        """Give every rank its heads of blocks a pull wrote into the transfer cache (one rank: nothing)."""
        if self._staging is not None and block_ids:
            self.runner.scatter_blocks(tuple(block_ids), self._staging)

    def stop_followers(self) -> None:
        """Release the other ranks of a tensor-parallel worker from their replay loop (they return)."""
        if self.mirror is not None:
            with self.mirror.lock:
                self.mirror.send(Stop())
            self.mirror = self.runner.mirror = None

    def _make_scheduler(self, scheduler_cls: type[Scheduler], watermark: float) -> Scheduler:
        return scheduler_cls(self.kv, self.config.max_num_batched_tokens, self.config.max_num_seqs,
                             watermark_blocks=int(watermark * self.block_pool.num_blocks))

    def use_scheduler(self, scheduler_cls: type[Scheduler], watermark: float = 0.0) -> None:
        """Change the scheduling policy (a worker changing role) over the same weights and KV cache.
        Only an idle engine may: no request scheduled and no block held (cached prefixes stay)."""
        if self.scheduler.num_unfinished or self.kv.num_requests or not self.block_pool.is_whole():
            raise RuntimeError(
                f"the engine still holds work ({self.scheduler.num_unfinished} requests, "
                f"{self.block_pool.num_used_blocks} blocks in use); drain it before changing its scheduler"
            )
        # The old scheduler's last finished requests never reach the runner now: forget their tables here.
        self.runner.forget_all()
        self.scheduler = self._make_scheduler(scheduler_cls, watermark)

    def check_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the problem if this request can never be served here."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of the vocabulary [0, {self.spec.vocab_size}): {bad[:5]}")
        total = len(prompt_token_ids) + sampling.max_tokens
        if total > self.spec.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds the maximum context length of {self.spec.max_model_len} tokens"
            )
        for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("stop_token_ids", sampling.stop_token_ids)):
            bad = [t for t in ids if t >= self.spec.vocab_size]
            if bad:
                raise ValueError(f"{name} token ids out of the vocabulary [0, {self.spec.vocab_size}): "
                                 f"{bad[:5]}")
        if blocks_for(total, self.config.block_size) > self.block_pool.num_blocks:
            raise ValueError(
                f"{total} tokens need more KV blocks than this worker has ({self.block_pool.num_blocks} "
                f"blocks of {self.config.block_size} tokens); raise the KV memory budget"
            )

    def add_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                    request_id: str | None = None) -> str:
        self.check_request(prompt_token_ids, sampling)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        eos = frozenset(self.spec.eos_token_ids)
        self.scheduler.add(Request(request_id, list(prompt_token_ids), sampling, eos))
        return request_id

    def fork_blocks(self, parent_id: str, child_ids: Sequence[str], num_tokens: int) -> None:
        """Give each child (a choice of the parent's prompt) a table sharing the parent's full blocks, with
        its own copy of the partial last one (KVCacheManager.fork); the parent's id holds nothing after."""
        self.runner.copy_blocks(self.kv.fork(parent_id, child_ids, num_tokens))

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def forward_step(self, before_forward: Callable[[ModelInput], None] | None = None) -> ForwardStep | None:
        """One forward: schedule → execute → update, the one place that runs them. None when the schedule is
        empty (nothing waits, or every waiting request needs blocks). `before_forward(batch)` runs between
        the schedule and the forward (a worker marks the batch's requests, publishes its load)."""
        if not self.scheduler.num_unfinished:
            return None
        batch = self.scheduler.schedule()
        if not batch.chunks:
            return None
        if before_forward is not None:
            before_forward(batch)
        output = self.runner.execute(batch)
        finished_at = time.time()
        advanced = self.scheduler.update(batch, output)
        return ForwardStep(batch, advanced, self.runner.timeline.last, finished_at)

    def step(self) -> list[RequestOutput]:
        forward = self.forward_step()
        advanced = forward.advanced if forward is not None else []
        return [
            RequestOutput(
                request_id=r.request_id,
                new_token_ids=(r.output_token_ids[-1],),
                new_logprobs=tuple(r.output_logprobs[-1:]) if r.sampling.logprobs else (),
                finish_reason=r.status.finish_reason if r.is_finished else None,
                new_top_logprobs=tuple(r.output_top_logprobs[-1:]),
                prompt_logprobs=r.scored_prompt() if r.num_output_tokens == 1 else None,
            )
            for r in advanced
        ]

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run the prompts to completion together; results in prompt order."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        for prompt, p in zip(prompts, params, strict=True):
            self.check_request(prompt, p)
        requests = []
        for prompt, p in zip(prompts, params, strict=True):
            request_id = self.add_request(prompt, p)
            requests.append(self.scheduler.requests[request_id])
        while any(not r.is_finished for r in requests):
            self.step()
        return [
            Completion(r.request_id, tuple(r.prompt_token_ids), tuple(r.output_token_ids),
                       tuple(r.output_logprobs), r.status.finish_reason, r.num_preemptions,
                       tuple(r.output_top_logprobs), r.scored_prompt())
            for r in requests
        ]
