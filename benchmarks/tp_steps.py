"""Engine step times at tensor-parallel degrees side by side: one rank against N ranks (llm_engine/
tensor_parallel.py), the same prompts, the same machine, one run; and whether the greedy tokens agree.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/tp_steps.py [--model DIR] [--degrees 1 2 3] [--repeats 5]

On a 2-core CPU the ranks share the cores and every all-reduce crosses processes over gloo: the figures show
what the split costs, not a speed-up (that needs a device per rank: benchmarks/gpu_check.py's TP section).
Prints a table; writes benchmarks/results/tp_steps.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.tp_spawn import start_other_ranks

RESULTS = Path(__file__).parent / "results"


def _follow(config: object, rank: int, size: int, init_method: str, threads: int) -> None:
    import torch

    from llm_engine.tensor_parallel import TPGroup, TPRank
    from llm_engine.tp_follower import TPFollower

    torch.set_num_threads(threads)
    TPFollower(config, TPGroup(TPRank(rank, size, init_method))).serve()  # type: ignore[arg-type]


def measure(model_dir: str, degree: int, repeats: int, prompt_len: int, batch: int, threads: int
            ) -> dict[str, object]:
    """Median ms of a prefill step (one prompt of `prompt_len` tokens) and of a decode step (`batch`
    streams)."""
    import torch

    from llm_engine import EngineConfig, LLMEngine
    from llm_engine.params import SamplingParams
    torch.set_num_threads(threads)
    config = EngineConfig(model_dir, dtype="float32", device="cpu", compile="off", kv_cache_bytes=256 << 20,
                          max_num_batched_tokens=max(512, prompt_len), tensor_parallel_size=degree)
    group, processes = start_other_ranks(config, _follow, threads) if degree > 1 else (None, [])
    engine = LLMEngine(config, tp_group=group)
    prefill_ms, decode_ms, tokens = [], [], []
    for repeat in range(repeats + 1):  # the first round warms up and is not counted
        prompts = [[(7 * repeat + 13 * i + j) % 1000 + 1 for j in range(prompt_len)] for i in range(batch)]
        sampling = SamplingParams(max_tokens=16, temperature=0.0)
        request_id = engine.add_request(prompts[0], sampling)
        started = time.perf_counter()
        engine.step()  # the whole prompt in one forward (max_num_batched_tokens >= prompt_len)
        if repeat:
            prefill_ms.append(1000 * (time.perf_counter() - started))
        engine.abort(request_id)
        while engine.has_unfinished():
            engine.step()
        for prompt in prompts:
            engine.add_request(prompt[:8], sampling)
        engine.step()  # the short prompts' prefill
        while engine.has_unfinished():
            started = time.perf_counter()
            engine.step()
            if repeat:
                decode_ms.append(1000 * (time.perf_counter() - started))
        if repeat == 1:
            tokens = [c.output_token_ids for c in engine.generate(prompts[:2], sampling)]
    engine.stop_followers()
    for process in processes:
        process.join(timeout=30)
    steps = sorted(decode_ms)
    return {"degree": degree, "prefill_step_ms_median": statistics.median(prefill_ms),
            "decode_step_ms_median": statistics.median(steps),
            "decode_step_ms_p10_p90": [steps[len(steps) // 10], steps[9 * len(steps) // 10]],
            "tokens": [list(t) for t in tokens]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model directory (default: SmolLM2-135M, prepared on first use)")
    parser.add_argument("--degrees", type=int, nargs="+", default=None,
                        help="degrees to compare (default: 1, 2, 3; SmolLM2's 9 heads over 2: 6 + 3)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="decode streams per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()
    from llm_engine.default_model import prepare_default_model

    model_dir = args.model or str(prepare_default_model())
    rows = [measure(model_dir, d, args.repeats, args.prompt_len, args.batch, args.threads)
            for d in args.degrees or [1, 2, 3]]
    print(f"model {model_dir}; {args.batch} decode streams; a {args.prompt_len}-token prefill; "
          f"{args.threads} thread(s) per rank; medians over {args.repeats} rounds")
    print("| ranks | prefill step, ms | decode step, ms [p10–p90] | greedy tokens = 1 rank's |")
    print("|---:|---:|---:|---|")
    for row in rows:
        spread: list[float] = row["decode_step_ms_p10_p90"]  # type: ignore[assignment]
        print(f"| {row['degree']} | {row['prefill_step_ms_median']:.1f} | {row['decode_step_ms_median']:.1f} "
              f"[{spread[0]:.1f}–{spread[1]:.1f}] | {row['tokens'] == rows[0]['tokens']} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tp_steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
