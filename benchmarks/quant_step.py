"""Engine step time of one model in several weight schemes, side by side in one process: the unquantized
checkpoint against what `pdserve quantize` makes of it (W8A8, W8A16, W4A16), rounds alternating the order.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quant_step.py [--shapes smollm2,smollm2-1.7b]
        [--schemes none,W8A8,W8A16,W4A16] [--decode 1@256,16@256] [--prefill 256] [--repeats 3]
        [--dtype bfloat16] [--compile off] [--out benchmarks/results/quant_step.md]
Shapes: `smollm2` is the default model (SmolLM2-135M-Instruct); `smollm2-1.7b` is SmolLM2-1.7B's config
(24 layers, hidden 2048, MLP 8192, 32 heads) with random weights written straight to safetensors, a shape
where the weights dominate a decode step as they do in the models people serve. Rows: a decode step (one
engine step() of B sequences at context C: schedule, attention, sampling; the median of --steps) and a
prefill step of one fresh prompt; each cell the median over rounds with its range, and the ratio to the
unquantized model's median of the same round set.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"
LARGE_SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24,
               "num_attention_heads": 32, "num_key_value_heads": 32}


def model_dirs(shape: str, schemes: list[str], root: Path) -> dict[str, Path]:
    """The shape's unquantized checkpoint and each scheme's, made once under `root`."""
    from llm_engine.checkpoint_quantizer import quantize_checkpoint
    from llm_engine.default_model import prepare_default_model

    base = prepare_default_model() if shape == "smollm2" else _large_model(root / shape)
    dirs = {}
    for scheme in schemes:
        if scheme == "none":
            dirs[scheme] = base
            continue
        out = root / f"{shape}-{scheme}"
        if not (out / "config.json").is_file():
            start = time.perf_counter()
            quantize_checkpoint(base, out, scheme)
            print(f"quantized {shape} to {scheme} in {time.perf_counter() - start:.0f} s", flush=True)
        dirs[scheme] = out
    return dirs


def _large_model(out: Path) -> Path:
    """SmolLM2-1.7B's shape, random bf16 weights (std 0.02), the default model's tokenizer files."""
    from safetensors.torch import save_file

    from llm_engine.default_model import prepare_default_model

    if (out / "config.json").is_file():
        return out
    source = prepare_default_model()
    config = json.loads((source / "config.json").read_text())
    config.update(LARGE_SHAPE, torch_dtype="bfloat16", dtype="bfloat16")
    hidden, mlp, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    generator = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden,
                                                                                                dtype=torch.bfloat16)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            tensors[f"{p}.self_attn.{name}.weight"] = rand(hidden, hidden)
        tensors[f"{p}.mlp.gate_proj.weight"] = rand(mlp, hidden)
        tensors[f"{p}.mlp.up_proj.weight"] = rand(mlp, hidden)
        tensors[f"{p}.mlp.down_proj.weight"] = rand(hidden, mlp)
        tensors[f"{p}.input_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        tensors[f"{p}.post_attention_layernorm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def decode_step_s(engine: Any, batch: int, context: int, steps: int, warmup: int, seed: int) -> float:
    """Median seconds of one engine step decoding `batch` sequences at about `context` tokens."""
    from llm_engine import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + warmup + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(torch.randint(0, engine.spec.vocab_size, (context,), generator=generator).tolist(),
                           params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    return statistics.median(step_seconds(engine)[warmup:])


def step_seconds(engine: Any) -> list[float]:
    """Seconds of each engine step until it has nothing left to do."""
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def write_report(out: Path, lines: list[str]) -> None:
    """Print the report and write it to `out` (its folder made)."""
    text = "\n".join(lines)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")


def prefill_step_s(engine: Any, length: int, seed: int) -> float:
    from llm_engine import SamplingParams

    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.spec.vocab_size, (length,), generator=generator).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="smollm2,smollm2-1.7b")
    parser.add_argument("--schemes", default="none,W8A8,W8A16,W4A16")
    parser.add_argument("--decode", default="1@256,16@256")
    parser.add_argument("--prefill", default="256")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile", default="off", choices=("off", "on"))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kv-cache-mib", type=int, default=1024, help="each engine's KV cache")
    parser.add_argument("--models", type=Path, default=RESULTS / "quant_models")
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_step.md")
    args = parser.parse_args()

    from llm_engine import EngineConfig, LLMEngine

    torch.set_num_threads(args.threads)
    schemes = args.schemes.split(",")
    decode = [tuple(map(int, d.split("@"))) for d in args.decode.split(",") if d]
    prefill = [int(n) for n in args.prefill.split(",") if n]
    lines = [f"# Engine steps by weight scheme ({platform.processor() or platform.machine()}, {args.threads} "
             f"threads, {args.dtype}, compile {args.compile}, {args.repeats} rounds)", ""]
    for shape in args.shapes.split(","):
        dirs = model_dirs(shape, schemes, args.models)
        engines = {}
        for scheme, path in dirs.items():
            engines[scheme] = LLMEngine(EngineConfig(str(path), dtype=args.dtype, device="cpu",
                                                     compile=args.compile,
                                                     kv_cache_bytes=args.kv_cache_mib << 20,
                                                     max_num_batched_tokens=max(2048, *prefill)))
            print(f"{shape} {scheme}: {engines[scheme].spec.weights}, linears "
                  f"{engines[scheme].linear_kernel.label}", flush=True)
        rows = [f"decode {b}@{c}" for b, c in decode] + [f"prefill {n}" for n in prefill]
        times: dict[str, dict[str, list[float]]] = {s: {r: [] for r in rows} for s in schemes}
        for round_index in range(args.repeats):
            order = schemes if round_index % 2 == 0 else schemes[::-1]
            for scheme in order:
                engine = engines[scheme]
                for b, c in decode:
                    step_s = decode_step_s(engine, b, c, args.steps, args.warmup, round_index)
                    times[scheme][f"decode {b}@{c}"].append(step_s)
                for n in prefill:
                    prefill_step_s(engine, n, 1000 + round_index)  # warm-up of the length
                    times[scheme][f"prefill {n}"].append(prefill_step_s(engine, n, 2000 + round_index))
            print(f"{shape}: round {round_index + 1} done", flush=True)
        lines += [f"## {shape}", "", "| step | " + " | ".join(schemes) + " |",
                  "|---|" + "---:|" * len(schemes)]
        for row in rows:
            base = statistics.median(times[schemes[0]][row])
            cells = []
            for scheme in schemes:
                values = times[scheme][row]
                median = statistics.median(values)
                cells.append(f"{1e3 * median:.1f} ms [{1e3 * min(values):.1f}–{1e3 * max(values):.1f}]"
                             + (f" **{median / base:.2f}×**" if scheme != schemes[0] else ""))
            lines.append(f"| {row} | " + " | ".join(cells) + " |")
        lines.append("")
        del engines
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
