"""(Over 300 lines: every call that reads or writes the KV cache the runner owns, the forward and a
tensor-parallel rank 0's gather and scatter of blocks among them, and the lm_head calls a rank > 0 replays:
one owner of the cache and its lock.)

Runs one forward of a packed, mixed prefill/decode batch over the paged KV cache and samples.

    execute(ModelInput) → ModelOutput:
        update the persistent block tables, pack new tokens [1, T] and positions, build the attention
        metadata (InputBatch.prepare) → model body → lm_head on the rows that sample only → logits
        processors (llm_engine/logits_processors.py) → choose tokens → their logprobs from the raw logits;
        and, for chunks that ask, the prompt tokens' logprobs (llm_engine/logprobs.py).
Owns the KV cache tensor and the runner's copy of the block tables; knows nothing of scheduling or Ray.
With tensor parallelism, rank 0's runner mirrors execute, copy_blocks, forget_all and the gather / scatter of
blocks that leave or arrive to the other ranks (llm_engine/tensor_parallel.py), whose runners replay them
(`replay`: the forward without sampling).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from llm_engine.batch import ModelInput, ModelOutput, SampledToken, ScheduledChunk
from llm_engine.compilation import BackgroundCompile, Body, CompileReport
from llm_engine.config import EngineConfig, ModelSpec
from llm_engine.custom_ops import step_context
from llm_engine.grammar_mask import GrammarMask
from llm_engine.input_batch import InputBatch
from llm_engine.kv_cache import KVCacheSpec
from llm_engine.kv_cache_manager import blocks_for
from llm_engine.logits_processors import LogitsPipeline, SamplingRows
from llm_engine.logprobs import prompt_logprobs, sampled_logprobs
from llm_engine.native_kernels import DecodeKernel, kernel_unfit_reason, paged_decode_attention
from llm_engine.params import PROMPT_ROWS_PER_SLICE, PromptLogprobsChunk, SamplingParams
from llm_engine.rank_shares import RankShare, spec_shares
from llm_engine.sampling import choose_tokens
from llm_engine.step_causes import SLOW_FACTOR, StepCauses, slow_cause
from llm_engine.step_timeline import StepRecord, StepTimeline
from llm_engine.structured import GrammarCache
from llm_engine.tensor_parallel import (
    CopyBlocks,
    Execute,
    ForgetAll,
    GatherBlocks,
    ScatterBlocks,
    StepMirror,
    TPGroup,
)
from llm_engine.token_bans import AllowedTokens, BadWords
from llm_engine.tp_sharding import VocabParallelHead
from llm_engine.varlen_attention import varlen_fits, varlen_kernel

logger = logging.getLogger(__name__)


def choose_decode_attention(config: EngineConfig, spec: ModelSpec | None = None
                            ) -> tuple[str, DecodeKernel | None]:
    """("paged-kernel", the kernel) or ("sdpa", None), as the config asks and the machine and the model's
    shape (`spec`; None: not checked) allow.

    Raises:
        RuntimeError: "paged-kernel" was asked for and does not build here or cannot serve the shape.
    """
    # "auto" is the kernel on a CPU where it builds. Gather + SDPA pads every decode row to the batch's
    # longest context: one 1500-token stream made four 100-token streams' step 208 ms where the kernel, which
    # reads each sequence's own blocks, took 87 (SmolLM2 fp32, 1 thread, AVX2 AMD); in batches of equal
    # contexts it measured within ±5% of SDPA. In bf16 it rounds the output's last bit differently from
    # SDPA: held to vLLM's standard (README, "Correctness"), not to bit parity.
    if config.decode_attention == "sdpa" or config.device != "cpu":
        return "sdpa", None
    if config.kv_cache_dtype != "auto":  # the C++ kernel reads float32 and bfloat16 caches
        if config.decode_attention == "paged-kernel":
            raise RuntimeError(f"decode_attention 'paged-kernel' reads float32 and bfloat16 caches, not "
                               f"--kv-cache-dtype {config.kv_cache_dtype}: use auto or sdpa")
        return "sdpa", None
    unfit = None if spec is None else kernel_unfit_reason(spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                                          config.block_size)
    if unfit is not None:
        if config.decode_attention == "paged-kernel":
            raise RuntimeError(f"decode_attention 'paged-kernel': the kernel is not built for {unfit}")
        return "sdpa", None
    kernel = paged_decode_attention()
    if kernel is None and config.decode_attention == "paged-kernel":
        raise RuntimeError("decode_attention 'paged-kernel': the kernel did not build here (see the log)")
    return ("paged-kernel", kernel) if kernel is not None else ("sdpa", None)


class ModelRunner:
    def __init__(self, model: nn.Module, spec: ModelSpec, config: EngineConfig, num_blocks: int,
                 body: Body | None = None, kv_cache: torch.Tensor | None = None,
                 mirror: StepMirror | None = None, compilation: CompileReport | None = None) -> None:
        """Args:
            body: the engine's own model body, compiled or not (llm_engine/compilation.py); None: run
                transformers' modules (`model.model`) with the paged attention plugged in.
            compilation: how `body` came to be; `compiling`: it is the eager body, compiled here on a thread
                of its own and swapped in between two forwards once done.
            spec: the model's shape, its max_model_len the effective one (EngineConfig.max_model_len).
            num_blocks: KV blocks to allocate (llm_engine/kv_sizing.py plan_kv_cache).
            kv_cache: those blocks, allocated by the caller (LLMEngine, under the node's memory lock);
                None: allocated here.
            mirror: rank 0 of a tensor-parallel worker: the other ranks, sent each call first; None: one rank,
                or a rank > 0 (driven by llm_engine/tp_follower.py).
        """
        self.mirror = mirror
        self.tp_group: TPGroup | None = None  # set by tp_follower for ranks > 0; rank 0's is mirror.group
        self.model = model
        self.lm_head = model.get_submodule("lm_head")
        # transformers' decoder (no lean body): looked up once, not on every step
        self.hf_body = model.get_submodule("model") if body is None else None
        self.body = body
        self.compilation = compilation or CompileReport("off", False, "transformers", "not built", 0.0, None)
        self.background_compile: BackgroundCompile | None = None
        if self.compilation.compiling and isinstance(body, nn.Module):
            self.background_compile = BackgroundCompile(body, torch.device(config.device), self._swap_body)
            self.background_compile.start()
        self.timeline = StepTimeline()  # every forward: when, how long, decode and prompt tokens
        self.causes = StepCauses()  # what a slow forward waited for (gc, a compile)
        self.spec = spec
        self.config = config
        self.device = torch.device(config.device)
        self.cache_spec = KVCacheSpec.from_model(spec, config)
        self.num_blocks = num_blocks
        # kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        self.kv_cache = (self.cache_spec.allocate(self.num_blocks, self.device) if kv_cache is None
                         else kv_cache)
        # A table never covers more than the model's context (check_request) nor more blocks than exist.
        max_blocks = min(blocks_for(spec.max_model_len, config.block_size), self.num_blocks)
        self.decode_attention, kernel = choose_decode_attention(config, spec)
        varlen = None if varlen_fits(self.device, config.torch_dtype, spec.head_dim) else varlen_kernel()
        if varlen is not None:  # CUDA: prefill chunks and decode tokens in one FlashAttention call
            self.decode_attention = "flash-varlen"
        self.inputs = InputBatch(self.kv_cache, max_blocks, config.max_num_batched_tokens,
                                 num_rows=config.max_num_seqs, decode_kernel=kernel, varlen_kernel=varlen,
                                 dtype=config.torch_dtype)
        # Structured outputs: compiled grammars cached per process, a matcher per request (rebuilt from its
        # tokens wherever it runs); llguidance is loaded with the first request that has a grammar.
        self.grammar_mask = GrammarMask(GrammarCache(config.model_dir, spec.vocab_size, spec.eos_token_ids))
        # The bans (allowed_token_ids, bad_words) before the grammar: it decides among what they leave.
        self.logits = LogitsPipeline(spec.vocab_size, spec.eos_token_ids, self.device,
                                     extra=(AllowedTokens(), BadWords(), self.grammar_mask))

    def _swap_body(self, body: Body, report: CompileReport) -> None:
        """The background compile is done (its thread): the next forward runs `body`. One attribute each,
        read once per forward: a forward under way finishes on the body it started with."""
        self.body, self.compilation = body, report

    def forget_all(self) -> None:
        """Drop every request's table and sampling state (the engine is idle; its scheduler is replaced)."""
        if self.mirror is not None:
            with self.mirror.lock:
                self.mirror.send(ForgetAll())
        self.logits.forget(tuple(self.inputs._rows))
        self.inputs.forget_all()

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (every layer, K and V), source → destination: the copy-on-write of a forked
        table's last partial block (KVCacheManager.fork)."""
        if pairs and self.mirror is not None:
            with self.mirror.lock:
                self.mirror.send(CopyBlocks(tuple(pairs)))
                self._copy_blocks(pairs)
        elif pairs:
            self._copy_blocks(pairs)

    def _copy_blocks(self, pairs: list[tuple[int, int]] | tuple[tuple[int, int], ...]) -> None:
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=self.device)
            dst = torch.tensor([d for _, d in pairs], device=self.device)
            self.kv_cache[dst] = self.kv_cache[src]  # [P, num_layers, 2, block_size, kv_heads, head_dim]

    @torch.inference_mode()
    def execute(self, batch: ModelInput) -> ModelOutput:
        """Compute every chunk's new tokens and sample for the chunks that ask for it (each forward is
        recorded in `timeline`)."""
        if self.mirror is not None:
            with self.mirror.lock:
                self.mirror.send(Execute(batch))
                return self._timed(batch)
        return self._timed(batch)

    def _timed(self, batch: ModelInput) -> ModelOutput:
        if not batch.chunks:
            return self._execute(batch)
        started = time.time()
        self.causes.mark()
        output = self._execute(batch)
        duration_ms = 1000 * (time.time() - started)
        gc_ms, num_compiled = self.causes.since_mark()
        num_decode = sum(1 for c in batch.chunks if c.output_index and c.num_tokens == 1)
        median = self.timeline.median_ms()
        cause = ""
        if median is not None and duration_ms > SLOW_FACTOR * median:
            cause = slow_cause(duration_ms, gc_ms, num_compiled)
            logger.warning("a forward took %.0f ms, %.0f× the recent median (%.1f ms): %s", duration_ms,
                           duration_ms / median, median, cause)
        self.timeline.record(StepRecord(started, duration_ms, num_decode, batch.num_tokens - num_decode,
                                        gc_ms, num_compiled, cause))
        return output

    @torch.inference_mode()
    def gather_blocks(self, block_ids: tuple[int, ...], staging: torch.Tensor) -> None:
        """Rank 0 of a tensor-parallel runner: every rank's heads of these blocks into `staging` (whole-head,
        [num_blocks, layers, 2, block_size, all kv heads, head_dim])."""
        assert self.mirror is not None
        with self.mirror.lock:
            self.mirror.send(GatherBlocks(block_ids))
            index = torch.tensor(block_ids, device=self.device)
            parts = self.mirror.group.gather_to_first(self._padded(self.kv_cache[index]))
            whole, covered = [], 0  # each KV head from the first rank that holds it (heads may be replicated)
            for part, share in zip(parts, self._shares(), strict=True):
                end = share.kv_start + share.num_kv_heads
                if end > covered:
                    whole.append(part[:, :, :, :, covered - share.kv_start : share.num_kv_heads])
                    covered = end
            staging[index] = torch.cat(whole, dim=4)

    @torch.inference_mode()
    def scatter_blocks(self, block_ids: tuple[int, ...], staging: torch.Tensor) -> None:
        """Rank 0: these blocks of `staging` split by heads into every rank's cache."""
        assert self.mirror is not None
        with self.mirror.lock:
            self.mirror.send(ScatterBlocks(block_ids))
            index = torch.tensor(block_ids, device=self.device)
            blocks = staging[index]
            chunks = [blocks[:, :, :, :, s.kv_start : s.kv_start + s.num_kv_heads] for s in self._shares()]
            received = self._padded(self.kv_cache[index])
            self.mirror.group.scatter_from_first([self._padded(chunk) for chunk in chunks], received)
            self.kv_cache[index] = received[:, :, :, :, :self.kv_cache.shape[4]]

    def _shares(self) -> list[RankShare]:
        group = self.mirror.group if self.mirror is not None else self.tp_group
        assert group is not None
        return spec_shares(self.spec, group.size)

    def _padded(self, blocks: torch.Tensor) -> torch.Tensor:
        """`blocks` [n, layers, 2, block_size, heads, head_dim] with as many heads as the largest share (rank
        0's: the collectives move tensors of one shape; where the heads divide evenly, `blocks` itself)."""
        most = self._shares()[0].num_kv_heads
        if blocks.shape[4] == most:
            return blocks.contiguous()
        padded = blocks.new_zeros((*blocks.shape[:4], most, blocks.shape[5]))
        padded[:, :, :, :, :blocks.shape[4]] = blocks
        return padded

    @torch.inference_mode()
    def replay(self, call: Execute | CopyBlocks | GatherBlocks | ScatterBlocks | ForgetAll) -> None:
        """A rank > 0: what rank 0's runner did, over this rank's slice (its KV heads, its tables)."""
        if isinstance(call, Execute):
            forwarded = self.forward(call.batch)
            if forwarded is not None and isinstance(self.lm_head, VocabParallelHead):
                self._replay_head(call.batch, *forwarded)
        elif isinstance(call, CopyBlocks):
            self._copy_blocks(call.pairs)
        elif isinstance(call, GatherBlocks | ScatterBlocks):
            assert self.tp_group is not None
            index = torch.tensor(call.block_ids, device=self.device)
            if isinstance(call, GatherBlocks):
                self.tp_group.gather_to_first(self._padded(self.kv_cache[index]))
            else:
                received = self._padded(self.kv_cache[index])
                self.tp_group.scatter_from_first([], received)
                self.kv_cache[index] = received[:, :, :, :, :self.kv_cache.shape[4]]
        else:
            self.inputs.forget_all()

    def _replay_head(self, batch: ModelInput, hidden: torch.Tensor, sample_rows: torch.Tensor | None) -> None:
        """A rank > 0: the vocab-parallel lm_head calls rank 0's _execute makes, in its order (each is a
        gather): prompt logprobs' slices (_score_prompts, prompt_logprobs), then the rows that sample."""
        q_start = 0
        for chunk in batch.chunks:
            num_rows = len(chunk.prompt_logprob_targets)
            for start in range(0, num_rows, PROMPT_ROWS_PER_SLICE):
                end = min(start + PROMPT_ROWS_PER_SLICE, num_rows)
                self.lm_head(hidden[0, q_start + start : q_start + end])
            q_start += chunk.num_tokens
        if any(c.sampling is not None for c in batch.chunks):
            self.lm_head(hidden[0] if sample_rows is None else hidden[0, sample_rows])

    def forward(self, batch: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The batch's tables updated and its tokens through the body (their KV written): (the hidden states
        [1, T, hidden], the rows that sample), or None for a batch of no chunks."""
        if not batch.chunks:
            self.inputs.forget(batch.finished_request_ids)
            return None
        prepared = self.inputs.prepare(batch)
        if self.body is not None:
            with step_context(prepared.metadata):
                hidden = self.body(prepared.input_ids[0], prepared.position_ids[0])[None]  # [1, T, hidden]
        else:
            assert self.hf_body is not None
            hidden = self.hf_body(
                input_ids=prepared.input_ids, position_ids=prepared.position_ids, use_cache=False,
                paged_metadata=prepared.metadata,
            ).last_hidden_state  # [1, T, hidden]
        return hidden, prepared.sample_rows

    def _execute(self, batch: ModelInput) -> ModelOutput:
        self.logits.forget(batch.finished_request_ids)
        forwarded = self.forward(batch)
        if forwarded is None:
            return ModelOutput(())
        hidden, sample_rows = forwarded
        scored = self._score_prompts(batch.chunks, hidden[0])
        sampling_chunks = [c for c in batch.chunks if c.sampling is not None]
        if not sampling_chunks:
            return ModelOutput((), scored)
        for chunk in sampling_chunks:
            if chunk.history is not None and chunk.sampling is not None:
                self.logits.register(chunk.request_id, chunk.sampling, chunk.history)
        # Project only the rows that sample: the vocab projection of every prompt token is wasted work.
        rows = hidden[0] if sample_rows is None else hidden[0, sample_rows]
        raw_logits = self.lm_head(rows).float()  # [num_samples, vocab]
        params = tuple(c.sampling for c in sampling_chunks if c.sampling is not None)
        sampling_rows = SamplingRows(tuple(c.request_id for c in sampling_chunks), params,
                                     tuple(c.output_index for c in sampling_chunks))
        logits = self.logits.apply(raw_logits, sampling_rows)
        token_ids = choose_tokens(logits, list(params), list(sampling_rows.output_indices))  # [num_samples]
        self.logits.record(sampling_rows, token_ids)
        logprobs = sampled_logprobs(raw_logits, token_ids, list(params))
        others = self._other_choices(sampling_chunks, params, raw_logits, logits)
        return ModelOutput(tuple(
            SampledToken(c.request_id, token,
                         logprobs[0][i] if logprobs is not None and params[i].logprobs else None,
                         logprobs[1][i] if logprobs is not None else (), others.get(i, ()))
            for i, (c, token) in enumerate(zip(sampling_chunks, token_ids.tolist(), strict=True))
        ), scored)

    @staticmethod
    def _other_choices(chunks: list[ScheduledChunk], params: tuple[SamplingParams, ...],
                       raw_logits: torch.Tensor, logits: torch.Tensor) -> dict[int, tuple[SampledToken, ...]]:
        """The first tokens of choices 1..n-1 of the rows whose request asks for n > 1 choices and samples its
        first token: drawn from that row's processed logits (the same for every choice before its first token:
        no output yet), each with its own seed. Keyed by row. Not recorded by the logits processors: the
        request stops at its first token (prefill worker), and each choice then registers its own history."""
        picks = [(row, index) for row, (c, p) in enumerate(zip(chunks, params, strict=True))
                 if p.n > 1 and c.output_index == 0 for index in range(1, p.n)]
        if not picks:
            return {}
        rows = torch.tensor([row for row, _ in picks], device=logits.device)
        choice_params = [params[row].for_choice(index) for row, index in picks]
        token_ids = choose_tokens(logits[rows], choice_params, [0] * len(picks))  # [num_picks]
        logprobs = sampled_logprobs(raw_logits[rows], token_ids, choice_params)
        others: dict[int, list[SampledToken]] = {}
        for i, ((row, _), token) in enumerate(zip(picks, token_ids.tolist(), strict=True)):
            others.setdefault(row, []).append(SampledToken(
                chunks[row].request_id, token,
                logprobs[0][i] if logprobs is not None and choice_params[i].logprobs else None,
                logprobs[1][i] if logprobs is not None else ()))
        return {row: tuple(tokens) for row, tokens in others.items()}

    def _score_prompts(self, chunks: tuple[ScheduledChunk, ...], hidden: torch.Tensor
                       ) -> tuple[PromptLogprobsChunk, ...]:
        """Prompt logprobs of the chunks that ask. hidden: [T, hidden] the packed rows of every chunk."""
        scored = []
        q_start = 0
        for chunk in chunks:
            targets = chunk.prompt_logprob_targets
            if targets:
                rows = hidden[q_start : q_start + len(targets)]
                first = chunk.start_position + 1  # the position of the first token scored
                scored.append(prompt_logprobs(rows, self.lm_head, chunk.request_id, first, targets,
                                              chunk.num_prompt_top_logprobs))
            q_start += chunk.num_tokens
        return tuple(scored)
