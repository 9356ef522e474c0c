"""lm-eval's loglikelihood path against pdserve: the same multiple-choice task scored by lm-eval's `hf` model
(transformers in this process) and by its `local-completions` model against a real `pdserve serve`
(1 prefill + 1 decode worker, fp32), then the two accuracies and every per-choice loglikelihood compared.

What this checks: that an eval harness, unmodified, reads pdserve's completions endpoint as it reads
vLLM's (`echo`, `logprobs: 1`, `max_tokens: 1`, prompts as token ids, `seed`) and that the prompt logprobs the
prefill worker computes are transformers' own (fp32: equal to ~1e-4), so the accuracies are the same, not
just close.
The task is local (benchmarks/lm_eval_task.py): no dataset or model hub is reached.

    .venv/bin/pip install -e '.[eval]'
    .venv/bin/python benchmarks/lm_eval_parity.py [--num-items 300] [--model DIR]
        [--out benchmarks/results/lm_eval]

Writes `results.json` (both runs' metrics, the per-choice comparison) and `results.md` under --out, and the
generated task (items + YAML) under --out/task.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from benchmarks.lm_eval_task import TASK_NAME, write_task

REPO_ROOT = Path(__file__).resolve().parent.parent
METRICS = ("acc,none", "acc_norm,none")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def pdserve(model_dir: str, port: int, startup_s: float = 600.0, dtype: str = "float32",
            extra: tuple[str, ...] = ()) -> Iterator[str]:
    """A `pdserve serve` subprocess (1 prefill + 1 decode, fp32 unless `dtype`, and `extra` flags) for the
    block; yields its base URL.

    Stopped with SIGINT, as a user's Ctrl-C, so that it shuts its own Ray cluster down."""
    command = [sys.executable, "-m", "pdserve", "serve", "--model", model_dir, "--dtype", dtype,
               "--prefill", "1", "--decode", "1", "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {process.returncode} before it was healthy")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"pdserve serve not healthy after {startup_s:.0f} s")
            time.sleep(2)
        yield url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def evaluate(model: str, model_args: dict[str, Any], task_dir: Path, batch_size: int) -> dict[str, Any]:
    """One lm-eval run of the local task; returns simple_evaluate's results (with per-sample outputs)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[TASK_NAME], batch_size=batch_size, log_samples=True,
        task_manager=TaskManager(include_path=str(task_dir)), bootstrap_iters=0)
    assert results is not None
    results["wall_s"] = time.perf_counter() - started
    return results


def loglikelihoods(results: dict[str, Any]) -> dict[int, list[float]]:
    """doc_id → the loglikelihood of each of its choices, as lm-eval scored them."""
    return {int(sample["doc_id"]): [float(resp[0]) for resp in sample["filtered_resps"]]
            for sample in results["samples"][TASK_NAME]}


def compare(reference: dict[int, list[float]], served: dict[int, list[float]]) -> dict[str, Any]:
    """The largest per-choice difference, and on how many items the two pick a different choice."""
    assert reference.keys() == served.keys(), "the runs scored different items"
    diffs = [(abs(a - b), doc_id) for doc_id in reference
             for a, b in zip(reference[doc_id], served[doc_id], strict=True)]
    largest, worst_doc = max(diffs)
    picks_differ = sum(1 for d in reference
                       if max(range(len(reference[d])), key=reference[d].__getitem__)
                       != max(range(len(served[d])), key=served[d].__getitem__))
    return {"num_items": len(reference), "num_choices": len(diffs), "max_abs_logprob_diff": largest,
            "max_diff_doc_id": worst_doc, "mean_abs_logprob_diff": sum(d for d, _ in diffs) / len(diffs),
            "num_items_argmax_differs": picks_differ}


def metrics(results: dict[str, Any]) -> dict[str, float]:
    return {name.split(",")[0]: float(results["results"][TASK_NAME][name]) for name in METRICS}


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    hf, served, cmp = report["hf"], report["pdserve"], report["comparison"]
    lines = [
        "# lm-eval: transformers (`hf`) vs pdserve (`local-completions`)", "",
        f"{report['date']} · {report['machine']} · model `{report['model']}` fp32 · task `{TASK_NAME}` "
        f"({report['num_items']} items, seed {report['seed']}, benchmarks/lm_eval_task.py) · "
        f"lm-eval {report['lm_eval_version']}", "",
        "| backend | acc | acc_norm | wall s |", "|---|---:|---:|---:|",
        f"| hf (transformers, batch {report['hf_batch_size']}) | {hf['acc']:.4f} | {hf['acc_norm']:.4f} "
        f"| {report['hf_wall_s']:.0f} |",
        f"| local-completions → pdserve serve (1 prefill + 1 decode, {report['num_concurrent']} concurrent) "
        f"| {served['acc']:.4f} | {served['acc_norm']:.4f} | {report['pdserve_wall_s']:.0f} |", "",
        f"Per choice ({cmp['num_choices']} loglikelihoods): largest |difference| "
        f"{cmp['max_abs_logprob_diff']:.2e} (doc {cmp['max_diff_doc_id']}), mean "
        f"{cmp['mean_abs_logprob_diff']:.2e}; items whose best choice differs: "
        f"{cmp['num_items_argmax_differs']}. Wall times are one run each on a machine shared with other "
        "work: not a throughput comparison.", "",
        f"Command: `{report['command']}`", ""]
    (out / "results.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-items", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model directory (default: the default model)")
    parser.add_argument("--port", type=int, default=0, help="pdserve's port (default: a free one)")
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--num-concurrent", type=int, default=4, help="local-completions' parallel requests")
    parser.add_argument("--out", default="benchmarks/results/lm_eval")
    args = parser.parse_args()
    # Nothing here may reach a hub: the model and the data are local.
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.model is None:
        from llm_engine.default_model import prepare_default_model
        args.model = str(prepare_default_model())
    out = Path(args.out)
    task_dir = write_task(out / "task", args.num_items, args.seed)

    hf = evaluate("hf", {"pretrained": args.model, "dtype": "float32", "device": "cpu"}, task_dir,
                  args.hf_batch_size)
    with pdserve(args.model, args.port or free_port()) as url:
        served_name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        served = evaluate("local-completions", {
            "model": served_name, "base_url": f"{url}/v1/completions", "tokenizer": args.model,
            "tokenizer_backend": "huggingface", "tokenized_requests": True,
            "num_concurrent": args.num_concurrent, "max_retries": 1}, task_dir, 1)

    import lm_eval
    report = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "model": Path(args.model).name, "num_items": args.num_items, "seed": args.seed,
        "lm_eval_version": getattr(lm_eval, "__version__", "?"), "hf_batch_size": args.hf_batch_size,
        "num_concurrent": args.num_concurrent, "hf": metrics(hf), "pdserve": metrics(served),
        "hf_wall_s": hf["wall_s"], "pdserve_wall_s": served["wall_s"],
        "comparison": compare(loglikelihoods(hf), loglikelihoods(served)),
        "command": " ".join(["python benchmarks/lm_eval_parity.py", *sys.argv[1:]]),
    }
    write_report(out, report)
    print((out / "results.md").read_text())
    if report["hf"] != report["pdserve"]:
        sys.exit("the accuracies differ")


if __name__ == "__main__":
    main()
