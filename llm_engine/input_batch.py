"""The model runner's persistent host-side state: every scheduled request's block table, and the step buffers.

Block-table rows: one row of a preallocated [num_rows, max_blocks] array per request that has a table at the
runner. Lifecycle of a row:
    a chunk with num_prior_blocks == 0 takes a free row (or restarts the request's own)
    → later chunks append only their new_block_ids to it
    → ModelInput.finished_request_ids gives it back (read before the chunks of the same forward).
A step therefore never copies whole tables; `prepare()` turns a ModelInput into the packed input tensors and
the attention metadata with a handful of numpy operations over arrays of one entry per chunk (no per-token
Python loop, no list padding), writing into buffers preallocated for `max_num_batched_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llm_engine.batch import ModelInput
from llm_engine.native_kernels import DecodeKernel
from llm_engine.paged_attention import DecodeBatch, PagedAttentionMetadata, PrefillSegment, cache_views
from llm_engine.varlen_attention import VarlenKernel, varlen_batch


@dataclass(frozen=True)
class PreparedInput:
    """One forward's tensors, built from a ModelInput."""

    input_ids: torch.Tensor  # [1, T] all chunks' new tokens, packed
    position_ids: torch.Tensor  # [1, T]
    metadata: PagedAttentionMetadata
    sample_rows: torch.Tensor | None  # [S] rows of the packed batch that sample; None when all T rows do


class InputBatch:
    def __init__(self, kv_cache: torch.Tensor, max_blocks_per_seq: int, max_num_tokens: int,
                 num_rows: int = 64, decode_kernel: DecodeKernel | None = None,
                 varlen_kernel: VarlenKernel | None = None, dtype: torch.dtype | None = None) -> None:
        """Args:
        kv_cache: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]; metadata points at it.
        decode_kernel: the C++ paged decode attention, passed to every layer; None: gather + SDPA.
        varlen_kernel: FlashAttention's varlen_attn (CUDA): every chunk in one call per layer; None: the
            per-segment SDPA and the decode path above.
        max_blocks_per_seq: the longest table a request can have (the model's context in blocks).
        max_num_tokens: tokens one forward may carry; larger batches grow the buffers.
        num_rows: initial number of table rows; doubled when more requests hold tables at once.
        dtype: the activations' (the decode mask's); None: the cache's (an 8-bit cache's is not).
        """
        self.kv_cache = kv_cache
        self.dtype = kv_cache.dtype if dtype is None else dtype
        self.decode_kernel = decode_kernel
        self.varlen_kernel = varlen_kernel
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self._block_rows = kv_cache.shape[1] * 2 * self.block_size  # rows of one block in [-1, kvh * D]
        self.cache_views = cache_views(kv_cache)
        self.tables = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int64)  # [rows, max_blocks]
        self._table_lens = np.zeros(num_rows, dtype=np.int64)  # blocks held in each row
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))  # a stack: pop() takes the lowest row
        self._alloc_token_buffers(max_num_tokens)

    def _alloc_token_buffers(self, num_tokens: int) -> None:
        self._input_ids = np.zeros(num_tokens, dtype=np.int64)
        self._positions = np.zeros(num_tokens, dtype=np.int64)
        self._arange = np.arange(num_tokens, dtype=np.int64)

    @property
    def num_rows_in_use(self) -> int:
        return len(self._rows)

    def _grow_rows(self) -> None:
        old = len(self.tables)
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self._table_lens = np.concatenate([self._table_lens, np.zeros_like(self._table_lens)])
        self._free_rows = list(range(2 * old - 1, old - 1, -1)) + self._free_rows

    def _row_for(self, request_id: str, new_block_ids: tuple[int, ...], num_prior_blocks: int) -> int:
        row = self._rows.get(request_id)
        if num_prior_blocks == 0 and row is None:
            if not self._free_rows:
                self._grow_rows()
            row = self._free_rows.pop()
            self._rows[request_id] = row
        if row is None or (num_prior_blocks != 0 and self._table_lens[row] != num_prior_blocks):
            # The scheduler and the runner disagree on a table: computing on would write KV to wrong blocks.
            raise RuntimeError(f"request {request_id}: chunk extends a table of {num_prior_blocks} blocks, "
                               f"the runner holds {None if row is None else int(self._table_lens[row])}")
        if new_block_ids:
            end = num_prior_blocks + len(new_block_ids)
            self.tables[row, num_prior_blocks:end] = new_block_ids
            self._table_lens[row] = end
        elif num_prior_blocks == 0:
            self._table_lens[row] = 0
        return row

    def forget_all(self) -> None:
        """Give back every row (the engine is idle and its scheduler is being replaced)."""
        self.forget(tuple(self._rows))

    def forget(self, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            row = self._rows.pop(request_id, None)
            if row is not None:
                self._free_rows.append(row)

    def prepare(self, batch: ModelInput) -> PreparedInput:
        """Update the tables with the batch's new blocks and build the forward's inputs."""
        self.forget(batch.finished_request_ids)
        chunks = batch.chunks
        num_chunks = len(chunks)
        rows = np.empty(num_chunks, dtype=np.int64)
        starts = np.empty(num_chunks, dtype=np.int64)
        counts = np.empty(num_chunks, dtype=np.int64)
        samples = np.empty(num_chunks, dtype=bool)
        token_ids: list[int] = []
        for i, chunk in enumerate(chunks):  # one entry per request: the only Python loop of a step
            rows[i] = self._row_for(chunk.request_id, chunk.new_block_ids, chunk.num_prior_blocks)
            starts[i] = chunk.start_position
            counts[i] = len(chunk.token_ids)
            samples[i] = chunk.sampling is not None
            token_ids.extend(chunk.token_ids)
        num_tokens = len(token_ids)
        if num_tokens > len(self._input_ids):
            self._alloc_token_buffers(num_tokens)
        input_ids = self._input_ids[:num_tokens]
        input_ids[:] = token_ids
        q_starts = np.cumsum(counts) - counts  # [C] first packed row of each chunk
        positions = self._positions[:num_tokens]
        if num_tokens == num_chunks:  # one token per chunk (all decode): positions are the starts
            positions[:] = starts
            token_rows = rows
        else:
            np.add(self._arange[:num_tokens], np.repeat(starts - q_starts, counts), out=positions)
            token_rows = np.repeat(rows, counts)
        block_indices = positions // self.block_size
        if (block_indices >= self._table_lens[token_rows]).any():
            raise RuntimeError("a chunk's tokens reach past its request's block table")
        slot_blocks = self.tables[token_rows, block_indices]  # [T]
        slot_offsets = positions % self.block_size  # [T]
        sample_ends = (q_starts + counts - 1)[samples]
        slot_rows = self._tensor(slot_blocks * self._block_rows + slot_offsets)
        varlen = None if self.varlen_kernel is None else varlen_batch(
            self.tables, rows, starts, counts, self.block_size, self._block_rows,
            self.cache_views.row_offsets, self.varlen_kernel, self._tensor)
        metadata = PagedAttentionMetadata(
            kv_cache=self.kv_cache,
            views=self.cache_views,
            slot_blocks=self._tensor(slot_blocks),
            slot_offsets=self._tensor(slot_offsets),
            slot_rows=slot_rows,
            layer_slot_rows=(slot_rows[None] + self.cache_views.row_offsets[:, None]).unbind(0),
            prefills=() if varlen else self._prefills(rows, starts, counts, q_starts),
            decode=None if varlen else self._decode(rows, starts, counts, q_starts),
            decode_kernel=self.decode_kernel,
            varlen=varlen,
        )
        return PreparedInput(
            input_ids=self._tensor(input_ids)[None],
            position_ids=self._tensor(positions)[None],
            metadata=metadata,
            sample_rows=None if len(sample_ends) == num_tokens else self._tensor(sample_ends),
        )

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        # from_numpy shares the persistent buffer's memory: no copy on the CPU; one upload on an accelerator,
        # staged through pinned memory (torch's caching host allocator): from pageable memory a non_blocking
        # copy is a synchronous one.
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            tensor = tensor.pin_memory()
        return tensor.to(self.device, non_blocking=True)

    def _prefills(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                  q_starts: np.ndarray) -> tuple[PrefillSegment, ...]:
        """A segment per chunk that is not a single decode token: one SDPA each in every layer."""
        segments = []
        for i in np.flatnonzero((counts > 1) | (starts == 0)).tolist():
            start, count, q_start = int(starts[i]), int(counts[i]), int(q_starts[i])
            context_len = start + count
            if start == 0:  # the chunk is its whole context: attend to its own fresh K/V, causally
                segments.append(PrefillSegment(q_start, count, context_len, None, None))
                continue
            num_blocks = -(-context_len // self.block_size)
            query_pos = torch.arange(start, context_len, device=self.device)
            key_pos = torch.arange(context_len, device=self.device)
            segments.append(PrefillSegment(
                q_start=q_start, q_len=count, context_len=context_len,
                block_ids=self._tensor(self.tables[rows[i], :num_blocks]),
                mask=key_pos[None, :] <= query_pos[:, None],
            ))
        return tuple(segments)

    def _decode(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                q_starts: np.ndarray) -> DecodeBatch | None:
        """All single-token rows with a cached context, attended to in one batched SDPA."""
        is_decode = (counts == 1) & (starts > 0)
        if not is_decode.any():
            return None
        q_rows = q_starts[is_decode]
        context_lens = starts[is_decode] + 1  # [B] keys each row sees, itself included
        max_len = int(context_lens.max())
        num_blocks = -(-max_len // self.block_size)
        # Columns past a row's own table hold stale (valid) block ids: their keys are masked out below.
        tables = self.tables[rows[is_decode], :num_blocks]  # [B, num_blocks]
        mask = None
        if int(context_lens.min()) != max_len and self.decode_kernel is None:  # the kernel reads lengths
            # Additive, in the model's dtype, once per step: a bool mask is converted again in every layer.
            visible = torch.arange(max_len)[None, :] < torch.from_numpy(context_lens)[:, None]  # [B, max_len]
            mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
            mask = mask[:, None, None].to(self.device, non_blocking=True)  # [B, 1, 1, max_len]
        first, count = int(q_rows[0]), len(q_rows)
        contiguous = int(q_rows[-1]) - first == count - 1  # then a slice: no index/index_put per layer
        q_indices = slice(first, first + count) if contiguous else self._tensor(q_rows)
        _, _, _, block_size, kv_heads, head_dim = self.kv_cache.shape
        gathered_shape = (count, num_blocks * block_size, kv_heads, head_dim)
        return DecodeBatch(q_indices, self._tensor(tables.reshape(-1)), gathered_shape, max_len, mask,
                           tables=None if self.decode_kernel is None else self._tensor(tables),
                           context_lens=None if self.decode_kernel is None else self._tensor(context_lens))
