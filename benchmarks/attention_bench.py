"""Decode attention over the paged KV cache against SDPA on contiguous KV and the memory bandwidth (no test).

One layer of SmolLM2's shape (9 query heads, 3 KV heads, head dim 64, 16-token blocks, blocks scattered in a
30-layer cache), per dtype, at each batch × context:
- paged kernel: pdserve's C++ decode attention reading the blocks in place (llm_engine/csrc/);
- gather + SDPA: every sequence's blocks copied out, then one batched SDPA (the engine's other path);
- SDPA, contiguous: the same keys already contiguous per sequence (what a non-paged engine pays; the floor
  for the SDPA paths);
- "of bandwidth": the K and V bytes read / the kernel's time, over a 512 MiB copy's read+write bandwidth.
Medians of 20 calls after 3 warm-up calls.

    .venv/bin/python benchmarks/attention_bench.py [--threads 1] [--out benchmarks/results/attention.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((1, 256), (16, 256), (1, 2048), (16, 2048), (1, 4096), (16, 4096))


def median_s(fn: Callable[[], object], calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.ones(128 << 20)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / min(median_s(lambda: dst.copy_(src), 5) for _ in range(2))


def row(kernel: Callable[..., torch.Tensor] | None, dtype: torch.dtype, batch: int, context: int,
        bandwidth: float) -> str:
    generator = torch.Generator().manual_seed(0)
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq + 8
    cache = torch.randn(num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq].view(batch, -1)
    lengths = torch.full((batch,), context, dtype=torch.long)
    query = torch.randn(batch, HEADS, HEAD_DIM, generator=generator).to(dtype)
    keys, values = cache[:, 7, 0], cache[:, 7, 1]  # one layer's [num_blocks, block, KVH, D] views
    flat_k, flat_v = keys.flatten(1), values.flatten(1)
    shape = (batch, context, KV_HEADS, HEAD_DIM)
    contiguous_k = flat_k.index_select(0, tables.reshape(-1)).view(shape).transpose(1, 2).contiguous()
    contiguous_v = flat_v.index_select(0, tables.reshape(-1)).view(shape).transpose(1, 2).contiguous()
    q4 = query[:, :, None]  # [B, H, 1, D]

    def gather_sdpa() -> torch.Tensor:
        k = flat_k.index_select(0, tables.reshape(-1)).view(shape).transpose(1, 2)
        v = flat_v.index_select(0, tables.reshape(-1)).view(shape).transpose(1, 2)
        return F.scaled_dot_product_attention(q4, k, v, scale=0.125, enable_gqa=True)

    with torch.inference_mode():
        times = {
            "paged kernel": median_s(lambda: kernel(query, keys, values, tables, lengths, 0.125))
            if kernel is not None else float("nan"),
            "gather + SDPA": median_s(gather_sdpa),
            "SDPA, contiguous": median_s(lambda: F.scaled_dot_product_attention(
                q4, contiguous_k, contiguous_v, scale=0.125, enable_gqa=True)),
        }
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * dtype.itemsize
    cells = [f"{t * 1e3:.3f} ({kv_bytes / t / bandwidth:.2f})" for t in times.values()]
    return f"| {str(dtype).removeprefix('torch.')} | {batch} | {context} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="benchmarks/results/attention.md")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm_engine.native_kernels import paged_decode_attention

    torch.set_num_threads(args.threads)
    kernel = paged_decode_attention()
    bandwidth = copy_bandwidth()
    lines = [
        f"# Decode attention, one layer ({args.threads} thread{'s' if args.threads > 1 else ''})", "",
        f"Copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s. ms per call (fraction of that bandwidth "
        "the K and V reads reach). SmolLM2's shape: 9 heads, 3 KV heads, head dim 64, 16-token blocks.",
        f"Command: `.venv/bin/python benchmarks/attention_bench.py {' '.join(sys.argv[1:])}`", "",
        "| dtype | batch | context | paged kernel | gather + SDPA | SDPA, contiguous |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in SHAPES:
            lines.append(row(kernel, dtype, batch, context, bandwidth))
            print(lines[-1], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
