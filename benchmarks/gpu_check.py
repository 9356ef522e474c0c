"""The GPU check, call A (engine + NCCL, no Ray): what a GPU machine proves first, sized for its 15 minutes.

    python benchmarks/gpu_check.py [--device cuda] [--layers 30] [--out $OUT/gpu_check.json]
Steps, each reported as it ends (a failure is recorded and the next step still runs):
  1. parity: a random-weight model of SmolLM2's shape (no download: the GGUF cannot travel) through the
     engine, compiled (--compile on) and eager, greedy against transformers' `generate` on the same device:
     float32 token-identical; bfloat16 by vLLM's standard (equal up to the first difference, each side's
     token in the other's top-5 there);
  2. step times: engine step vs the bare transformers forward, prefill 256/1024/2048, decode 1/16/64 at
     context 256, bf16, compiled and eager (medians of --repeats);
  4. tensor parallel (2 GPUs): two ranks with NCCL all-reduces, float32 greedy tokens against one rank's and
     the decode step at 1 and 2 ranks (skipped with fewer GPUs; on a CPU dry run: gloo);
  3. NCCL: two processes on one GPU (distinct NCCL_HOSTID per rank, over loopback: the code path, not the
     speed), the pair warm-up (kv_transfer/backends/torch_group.py warm_up_pairs), then a 64 MiB isend/irecv
     byte-checked, with GB/s beside a device copy.
Runs on a CPU too (`--device cpu --layers 2`: a dry run of the script itself; NCCL becomes gloo). Not yet
here: NIXL VRAM→VRAM between two processes, and call B (Ray + the gateway end to end: a served greedy request,
a stream, n=2, 16 concurrent). It writes gpu_check.json to $OUT (the device machine's folder that comes
back), else to benchmarks/results/; its figures then go to benchmarks/README.md with the command. What
travels: the repo alone (no model, no wheels): the GPU machine has torch, transformers, msgpack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.closeness import first_divergence, reference
from benchmarks.quant_step import step_seconds

RESULTS: dict[str, Any] = {}


def step(name: str):  # type: ignore[no-untyped-def]
    """Run the decorated check now, record its result or its failure under `name`, and print it."""
    def run(fn):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        try:
            RESULTS[name] = {"ok": True, **fn()}
        except Exception as error:
            RESULTS[name] = {"ok": False, "error": f"{type(error).__name__}: {error}",
                             "trace": traceback.format_exc()[-2000:]}
        RESULTS[name]["seconds"] = round(time.perf_counter() - start, 1)
        print(name, json.dumps(RESULTS[name], default=str)[:2000], flush=True)
        return fn
    return run


def build_model(out: Path, layers: int) -> Path:
    """SmolLM2-135M's shape (hidden 576, 9 heads / 3 KV heads, head_dim 64, vocab 49152), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         initializer_range=0.2, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def engine_for(model_dir: Path, dtype: str, device: str, compile_mode: str) -> Any:
    from llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(str(model_dir), dtype=dtype, device=device, compile=compile_mode,
                                  kv_cache_bytes=2 << 30, max_num_batched_tokens=2048, max_num_seqs=64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                      "gpu_check.json"))
    args = parser.parse_args()
    device = args.device
    work = Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    model_dir = build_model(work / "model", args.layers)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=generator).tolist() for n in (9, 40, 130, 300)]
    RESULTS["setup"] = {"device": device, "torch": torch.__version__, "layers": args.layers,
                        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None}

    @step("parity")
    def parity() -> dict[str, Any]:
        from llm_engine.params import SamplingParams

        report: dict[str, Any] = {}
        for dtype in ("float32", "bfloat16"):
            expected = reference(model_dir, prompts, 24, getattr(torch, dtype), device)
            for mode in ("on", "off"):
                engine = engine_for(model_dir, dtype, device, mode)
                params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=True,
                                        top_logprobs=5)
                done = engine.generate(prompts, params)
                rows = [first_divergence(list(c.output_token_ids),
                                         [{t for t, _ in s} for s in c.output_top_logprobs], ref, top)
                        for c, (ref, top) in zip(done, expected, strict=True)]
                report[f"{dtype} {mode}"] = {
                    "compiled": engine.compilation.compiled,
                    "compile_s": round(engine.compilation.seconds, 1),
                    "identical": all(r["position"] is None for r in rows),
                    "close": all(r["close"] for r in rows),
                    "first_divergence": [r["position"] for r in rows],
                    "blocks_whole": engine.block_pool.is_whole()}
        return report

    @step("step_times")
    def step_times() -> dict[str, Any]:
        from transformers import AutoModelForCausalLM

        from llm_engine.params import SamplingParams

        dtype = "bfloat16" if device.startswith("cuda") else "float32"
        bare = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        report: dict[str, Any] = {"dtype": dtype}
        for mode in ("on", "off"):
            engine = engine_for(model_dir, dtype, device, mode)
            rows: dict[str, Any] = {}
            for length in (256, 1024, 2048):
                times, bare_times = [], []
                for _ in range(args.repeats):
                    prompt = torch.randint(0, 49152, (length,), generator=generator).tolist()
                    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
                    sync()
                    start = time.perf_counter()
                    engine.step()
                    sync()
                    times.append(time.perf_counter() - start)
                    with torch.inference_mode():
                        start = time.perf_counter()
                        bare(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1)
                        sync()
                        bare_times.append(time.perf_counter() - start)
                rows[f"prefill {length}"] = {"engine_ms": 1e3 * statistics.median(times[1:]),
                                             "bare_ms": 1e3 * statistics.median(bare_times[1:])}
            for batch in (1, 16, 64):
                for _ in range(batch):
                    engine.add_request(torch.randint(0, 49152, (256,), generator=generator).tolist(),
                                       SamplingParams(max_tokens=args.repeats + 4, temperature=0.0,
                                                      ignore_eos=True))
                while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
                    engine.step()
                times = []
                while engine.has_unfinished():
                    sync()
                    start = time.perf_counter()
                    engine.step()
                    sync()
                    times.append(time.perf_counter() - start)
                rows[f"decode {batch}@256"] = {"engine_ms": 1e3 * statistics.median(times[1:-1])}
            report[f"compile {mode}"] = rows
        return report

    @step("nccl")
    def nccl() -> dict[str, Any]:
        import multiprocessing as mp

        context = mp.get_context("spawn")
        queue = context.Queue()
        init = work / "nccl-init"
        ranks = [context.Process(target=_nccl_rank, args=(rank, str(init), device, queue)) for rank in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(timeout=240)
        results = [queue.get(timeout=5) for _ in ranks if not queue.empty()]
        if any(p.exitcode != 0 for p in ranks) or len(results) != 2:
            raise RuntimeError(f"rank exit codes {[p.exitcode for p in ranks]}; results {results}")
        return {"ranks": sorted(results, key=lambda r: r["rank"])}

    @step("tensor_parallel")
    def tensor_parallel() -> dict[str, Any]:
        """Two ranks, one GPU each, NCCL all-reduces (llm_engine/tensor_parallel.py): float32 greedy tokens
        against one rank's, and the decode step at 1 and 2 ranks. Needs 2 GPUs (skipped on fewer)."""
        import multiprocessing as mp

        from llm_engine import EngineConfig, LLMEngine
        from llm_engine.params import SamplingParams
        from llm_engine.tensor_parallel import TPGroup, TPRank, bind_group_address
        from llm_engine.tiny_model import build_tiny_llama

        gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
        if device.startswith("cuda") and gpus < 2:
            return {"skipped": f"{gpus} GPU here; two ranks need two"}
        tiny = build_tiny_llama(work / "tp-tiny")  # 8 / 2 heads: splits over 2 ranks (SmolLM2's 9 / 3 not)
        config = EngineConfig(str(tiny), dtype="float32", device="cuda:0" if gpus else "cpu", compile="off",
                              kv_cache_bytes=64 << 20, tensor_parallel_size=2)
        prompts = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 300))]
        sampling = SamplingParams(max_tokens=32, temperature=0.0)
        one = LLMEngine(replace(config, tensor_parallel_size=1))
        expected = [c.output_token_ids for c in one.generate(prompts, sampling)]
        init = bind_group_address("127.0.0.1", 2)
        backend = "nccl" if gpus else "gloo"
        follower = mp.get_context("spawn").Process(target=_tp_rank, args=(config, init, backend, bool(gpus)))
        follower.start()
        two = LLMEngine(config, tp_group=TPGroup(TPRank(0, 2, init, backend)))
        got = [c.output_token_ids for c in two.generate(prompts, sampling)]
        timings = {}
        for name, engine in (("1 rank", one), ("2 ranks", two)):
            for i in range(16):
                engine.add_request([i + 1] * 64, SamplingParams(max_tokens=args.repeats + 4, temperature=0.0))
            engine.step()
            times = step_seconds(engine)
            timings[f"decode 16@64, {name}, ms"] = round(1e3 * statistics.median(times), 2)
        two.stop_followers()
        follower.join(timeout=60)
        return {"greedy_equal": got == expected, **timings, "follower_exit": follower.exitcode}

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(RESULTS, indent=1, default=str))
    print("written to", args.out)


def _tp_rank(config: Any, init: str, backend: str, on_gpu: bool) -> None:
    """Rank 1 of the tensor-parallel check, on the second GPU."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm_engine.tensor_parallel import TPGroup, TPRank
    from llm_engine.tp_follower import TPFollower

    if on_gpu:
        torch.cuda.set_device(1)
        config = replace(config, device="cuda:1")
    TPFollower(config, TPGroup(TPRank(1, 2, init, backend))).serve()


def _nccl_rank(rank: int, init_file: str, device: str, queue: Any) -> None:
    """One rank: join, warm up the pair, move 64 MiB rank 0 → rank 1, byte-check, time it."""
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kv_transfer.backends.torch_group import warm_up_pairs

    is_cuda = device.startswith("cuda")
    os.environ["NCCL_HOSTID"] = f"pdserve-rank-{rank}"  # two ranks on one GPU: NCCL refuses them otherwise
    dist.init_process_group("nccl" if is_cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    where = torch.device(device)
    warm_up_pairs(rank, 2, where)
    payload = torch.arange(16 << 20, dtype=torch.int32, device=where)  # 64 MiB
    result: dict[str, Any] = {"rank": rank}
    for _ in range(3):
        buffer = payload.clone() if rank == 0 else torch.empty_like(payload)
        if is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        (dist.isend if rank == 0 else dist.irecv)(buffer, 1 - rank).wait()
        if is_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        result["gb_per_s"] = round(payload.numel() * 4 / seconds / 1e9, 2)
        if rank == 1:
            result["bytes_equal"] = bool(torch.equal(buffer, payload))
    start = time.perf_counter()
    payload.clone()
    if is_cuda:
        torch.cuda.synchronize()
    result["device_copy_gb_per_s"] = round(2 * payload.numel() * 4 / (time.perf_counter() - start) / 1e9, 2)
    dist.destroy_process_group()
    queue.put(result)


if __name__ == "__main__":
    main()
