"""The processes one soak starts and stops, by pid: its own Ray head and `pdserve serve` on it.

Also what those processes are: the pids of the gateway's worker actors (from the GCS actor table) and the
model directory the server is given. Nothing here touches a process this soak did not start.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import psutil

from tests.reliability.soaklib.config import SoakConfig

REPO = Path(__file__).resolve().parents[3]  # soaklib → reliability → tests → the repository
BIN = Path(sys.executable).parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SoakSystem:
    """The Ray head and the server of one soak run; each is a child process of this one."""

    def __init__(self, config: SoakConfig, work_dir: Path) -> None:
        self.config = config
        self.work_dir = work_dir  # short path under /tmp: Ray's socket paths must stay short
        self.ray_port = _free_port()
        self.http_port = _free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        # Ray's head turns token auth on; every process joining it needs the token: this run's own, in this
        # process's environment too (the worker faults join as a driver). UCX stays on loopback.
        os.environ.setdefault("RAY_AUTH_TOKEN", uuid.uuid4().hex)
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "UCX_NET_DEVICES": "lo"}
        self.ray_head: subprocess.Popen[bytes] | None = None
        self.server: subprocess.Popen[bytes] | None = None

    def start_ray(self) -> None:
        ports = {flag: str(_free_port()) for flag in (
            "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")}
        # Worker ports away from Ray's default 10002-19999, which other Ray instances on this machine use.
        first_worker_port = random.Random().randrange(20000, 29000, 200)
        command = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(self.ray_port),
                   "--num-cpus", str(self.config.num_ray_cpus
                                     or self.config.num_prefill + self.config.num_decode + 1),
                   "--temp-dir", str(self.work_dir / "ray"), "--include-dashboard=false",
                   "--disable-usage-stats", "--object-store-memory", str(512 << 20),
                   "--min-worker-port", str(first_worker_port),
                   "--max-worker-port", str(first_worker_port + 199),
                   *[x for item in ports.items() for x in item]]
        log = (self.config.out_dir / "ray_head.log").open("wb")
        self.ray_head = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        ready = self.work_dir / "ray" / "ray_current_cluster"  # written once the head has started
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.ray_head.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Ray head did not start; see {self.config.out_dir / 'ray_head.log'}")
            time.sleep(0.5)

    def start_server(self, model_dir: Path, extra_args: tuple[str, ...] = (),
                     append_log: bool = False) -> float:
        """Start `pdserve serve` and wait until /health says ok; returns the seconds that took."""
        pdserve = [str(BIN / "pdserve")] if (BIN / "pdserve").exists() else [sys.executable, "-m",
                                                                             "pdserve"]
        command = [*pdserve, "serve", "--model", str(model_dir), "--port", str(self.http_port),
                   "--address", f"127.0.0.1:{self.ray_port}", "--prefill", str(self.config.num_prefill),
                   "--decode", str(self.config.num_decode), *self.config.serve_args, *extra_args]
        log = (self.config.out_dir / "server.log").open("ab" if append_log else "wb")
        started = time.monotonic()
        self.server = subprocess.Popen(command, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = started + 600
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).json().get("status") == "ok":
                    return time.monotonic() - started
            except (httpx.HTTPError, ValueError):
                pass
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve serve did not come up; see {self.config.out_dir / 'server.log'}")
            time.sleep(1)

    def stop_server(self, timeout_s: float = 90.0) -> None:
        """SIGINT the server (the supervisor stops its frontends; a named fleet outlives it) and wait."""
        if self.server is None or self.server.poll() is not None:
            return
        self.server.send_signal(signal.SIGINT)
        try:
            self.server.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()

    def processes(self) -> list[psutil.Process]:
        """Every live process of the system: the server and the Ray head, with all their descendants."""
        found = []
        for root in (self.server, self.ray_head):
            if root is None or root.poll() is not None:
                continue
            try:
                parent = psutil.Process(root.pid)
                found += [parent, *parent.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return found

    def frontend_pids(self) -> list[int]:
        """`--api-server-count N`: uvicorn's spawned children of the server (its frontends), not Ray's."""
        if self.server is None or self.server.poll() is not None:
            return []
        pids = []
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.server.pid).children():
                with contextlib.suppress(psutil.Error):
                    if "spawn_main" in " ".join(child.cmdline()):
                        pids.append(child.pid)
        return pids

    def fleet_actor_pid(self) -> int | None:
        """`--api-server-count N`: the fleet actor's process (Ray titles it after the class), if up now."""
        for process in self.processes():
            with contextlib.suppress(psutil.Error):
                if "FleetActor" in " ".join(process.cmdline()):
                    return process.pid
        return None

    def stop(self) -> None:
        """The server first (it shuts its actors down), then the Ray head; stragglers get SIGKILL by pid."""
        leftovers = self.processes()
        self.stop_server()
        if self.ray_head is not None and self.ray_head.poll() is None:
            self.ray_head.send_signal(signal.SIGTERM)  # `ray start --block` then stops what it started
            try:
                self.ray_head.wait(90)
            except subprocess.TimeoutExpired:
                self.ray_head.kill()
                self.ray_head.wait()
        for process in leftovers:
            try:
                if process.is_running():  # also checks that the pid was not reused
                    process.kill()
            except psutil.NoSuchProcess:
                pass


def worker_pids() -> tuple[dict[str, int], dict[int, str]]:
    """(worker id → pid of its live actor, pid → worker id of every actor so far), from the GCS actor table.

    The public state API (ray.util.state) needs the dashboard, which this head runs without.
    """
    from ray._private import state

    alive, every = {}, {}
    for info in state.actors().values():
        if info["Name"].startswith("pdserve-") and info["Pid"]:
            worker_id = info["Name"].removeprefix("pdserve-")
            every[int(info["Pid"])] = worker_id
            if info["State"] == "ALIVE":
                alive[worker_id] = int(info["Pid"])
    return alive, every


def prepare_model(model: str | None, work_dir: Path) -> Path:
    """The model directory to serve: --model DIR; SmolLM2 for "default"; else a tiny random Llama.

    The tiny Llama gets SmolLM2's tokenizer and chat template, so chat requests work on it too.
    """
    from llm_engine.default_model import prepare_default_model

    if model == "default":
        return prepare_default_model()
    if model is not None:
        return Path(model).resolve()
    from llm_engine.tiny_model import build_tiny_llama

    smollm2 = prepare_default_model()
    out = build_tiny_llama(work_dir / "tiny-chat", vocab_size=49152)
    for name in TOKENIZER_FILES:
        if (smollm2 / name).is_file():
            shutil.copy2(smollm2 / name, out / name)
    return out

