"""KV handed between workers of different tensor-parallel degrees over NIXL, the two ways pdserve can do it,
side by side in one run: "rank slices" (each destination rank reads its heads from the source ranks that hold
them: kv_transfer/head_slices.py) against "rank 0 staging" (the source's ranks gathered into rank 0's
whole-head copy, one READ of whole blocks, the destination's rank 0 scattering them to its ranks: what every
backend did before, and the torch backend still does).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_handoff.py [--model DIR] [--tokens 256 2048] [--repeats 7]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_handoff.py --kv-shape llama-8b --tokens 4096 \
        --kv-cache-mib 1100

--kv-shape llama-8b builds a random model with a Llama-3-8B's KV (32 layers, 8 KV heads of 128, blocks of
16 tokens: 2 MiB a block, 128 KiB a token) and small weights: what the handoff moves is what an 8B moves,
past the 64 MiB rank scratch from 512 tokens on (SmolLM2's 2048-token KV fits it).

Each handoff is timed from the offer (the gather first, for staging) until the destination holds the KV (the
scatter last) and the source is told PULLED. Both workers' rank 0 live in this process, their other ranks in
processes of their own; everything on this machine's cores (UCX over shared memory). Also printed: the KV
blocks each layout gets from the same budget (staging pays for rank 0's whole-head copy).
Writes benchmarks/results/tp_handoff.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.tp_spawn import start_other_ranks

RESULTS = Path(__file__).parent / "results"
LAYOUTS = ((2, 1), (1, 2), (2, 2))  # (prefill ranks, decode ranks)


def _follow(config: Any, rank: int, size: int, init_method: str, worker_id: str) -> None:
    import torch

    from kv_transfer.backends.nixl_ranks import RankTransfers
    from llm_engine.tensor_parallel import TPGroup, TPRank
    from llm_engine.tp_follower import TPFollower

    torch.set_num_threads(1)
    follower = TPFollower(config, TPGroup(TPRank(rank, size, init_method)))
    if not config.tp_staging:
        follower.rank_handler = RankTransfers(worker_id, rank, follower.first_kv_head,
                                              follower.runner.kv_cache).handle
    follower.serve()


def _engine(config: Any, worker_id: str) -> tuple[Any, list[Any]]:
    from llm_engine import LLMEngine

    if config.tensor_parallel_size == 1:
        return LLMEngine(config), []
    group, processes = start_other_ranks(config, _follow, worker_id)
    return LLMEngine(config, tp_group=group), processes


def measure(base: Any, src_tp: int, dst_tp: int, staging: bool, token_counts: list[int], repeats: int
            ) -> dict[str, Any]:
    """Median ms per handoff of each prompt length, for one pair of degrees and one way."""
    from kv_transfer import ReleaseReason, TransferState, make_receiver, make_sender

    tag = f"{src_tp}to{dst_tp}-{'staging' if staging else 'slices'}"
    prefill, prefill_ranks = _engine(replace(base, tensor_parallel_size=src_tp, tp_staging=staging),
                                     f"p-{tag}")
    decode, decode_ranks = _engine(replace(base, tensor_parallel_size=dst_tp, tp_staging=staging),
                                   f"d-{tag}")
    sender = make_sender("nixl", f"p-{tag}", prefill.transfer_cache, ranks=prefill.rank_call)
    receiver = make_receiver("nixl", f"d-{tag}", decode.transfer_cache, ranks=decode.rank_call)
    receiver.add_peer(sender.peer_info())
    row: dict[str, Any] = {"prefill_tp": src_tp, "decode_tp": dst_tp, "ms": {},
                           "way": "rank 0 staging" if staging else "rank slices",
                           "blocks": [prefill.kv_capacity.num_blocks, decode.kv_capacity.num_blocks]}
    for tokens in token_counts:
        ids = tuple(range(-(-tokens // base.block_size)))
        times = []
        for repeat in range(repeats + 1):  # the first warms up
            started = time.perf_counter()
            prefill.export_blocks(ids)
            handle = sender.offer(ids, tokens)
            receiver.start_pull(handle, ids)
            results, released = [], []
            while not (results and released):
                results += receiver.poll()
                released += sender.poll()
            decode.import_blocks(ids)
            if repeat:
                times.append(1000 * (time.perf_counter() - started))
            assert results[0].state == TransferState.DONE, results
            assert released[0].reason == ReleaseReason.PULLED, released
        row["ms"][tokens] = {"median": statistics.median(times), "min": min(times), "max": max(times)}
    receiver.close()
    sender.close()
    for engine, ranks in ((prefill, prefill_ranks), (decode, decode_ranks)):
        engine.stop_followers()
        for process in ranks:
            process.join(timeout=30)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M, prepared on first use)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048],
                        help="prompt lengths handed over")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kv-cache-mib", type=int, default=128, help="each worker's KV budget")
    parser.add_argument("--kv-shape", choices=("model", "llama-8b"), default="model",
                        help="llama-8b: a random model with a Llama-3-8B's KV shape instead of --model")
    args = parser.parse_args()
    import torch

    from llm_engine import EngineConfig
    from llm_engine.default_model import prepare_default_model

    torch.set_num_threads(1)
    model_dir = args.model or str(prepare_default_model())
    if args.kv_shape == "llama-8b":
        import tempfile

        from llm_engine.tiny_model import build_tiny_model

        out = Path(tempfile.mkdtemp(prefix="kv-8b-"))
        model_dir = str(build_tiny_model("llama", out, num_hidden_layers=32, num_attention_heads=8,
                                         num_key_value_heads=8, head_dim=128, hidden_size=256,
                                         intermediate_size=256))
    base = EngineConfig(model_dir, dtype=args.dtype, device="cpu", compile="off",
                        kv_cache_bytes=args.kv_cache_mib << 20)
    rows = []
    for src_tp, dst_tp in LAYOUTS:
        for staging in (True, False):  # side by side, the same machine and minute
            rows.append(measure(base, src_tp, dst_tp, staging, args.tokens, args.repeats))
    print(f"model {model_dir}, {args.dtype}; ms per handoff, median [min–max] of {args.repeats}; KV "
          f"blocks of rank 0 from a {args.kv_cache_mib} MiB budget (prefill, decode)")
    print("| prefill ranks → decode ranks | way | " + " | ".join(f"{t} tokens, ms" for t in args.tokens)
          + " | KV blocks |")
    print("|---|---|" + "---:|" * len(args.tokens) + "---|")
    for row in rows:
        cells = [f"{row['ms'][t]['median']:.1f} [{row['ms'][t]['min']:.1f}–{row['ms'][t]['max']:.1f}]"
                 for t in args.tokens]
        print(f"| {row['prefill_tp']} → {row['decode_tp']} | {row['way']} | " + " | ".join(cells)
              + f" | {row['blocks'][0]}, {row['blocks'][1]} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_handoff.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
