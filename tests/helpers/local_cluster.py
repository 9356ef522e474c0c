"""A multi-node Ray cluster on this one machine: a head and worker nodes, each its own `ray start` process.

Every node is a separate raylet with its own resources (e.g. {"pdserve_decode": 1}), so placement, node ids,
cross-node transfers and node loss behave as on separate machines, except that the nodes share one IP and
one disk. Everything runs in this worktree's code (PYTHONPATH), under its own auth token (no ~/.ray file is
written or read), and is stopped by pid: never `ray stop` on a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports: each free_port() releases its port, so two calls can return the same one
    (a raylet's runtime-env agent and metrics exporter once got 57045 both, and `ray start` refused)."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def node_address() -> tuple[str, str]:
    """(IP, interface) of this machine's first non-loopback IPv4 interface; loopback if it has none."""
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address, name
    return "127.0.0.1", "lo"


@dataclass
class RayNode:
    process: subprocess.Popen[bytes]  # `ray start --block`: parent of the node's raylet and its workers
    resources: dict[str, float]
    log: Path
    node_manager_port: str  # in the raylet's command line: finds a failed start's stragglers


class LocalRayCluster:
    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir  # short path: Ray's socket paths must stay short
        self.ip, self.interface = node_address()
        self.port = free_port()
        self.address = f"{self.ip}:{self.port}"
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),  # workers import this worktree, not an installed copy
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex,
            # The head declares a node dead ~1.5 s after its raylet stops answering (default ~15 s+).
            "RAY_health_check_period_ms": "500", "RAY_health_check_timeout_ms": "500",
            "RAY_health_check_failure_threshold": "3",
            "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
        }
        self.nodes: list[RayNode] = []
        self.head: RayNode | None = None

    def _start(self, args: list[str], resources: dict[str, float], name: str) -> RayNode:
        flags = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")
        ports = {flag: str(port) for flag, port in zip(flags, free_ports(len(flags)), strict=True)}
        # Worker ports away from Ray's default range, which other Ray instances on this machine use, and below
        # the kernel's ephemeral range (32768-60999 on Linux), where every free_port() above comes from: a
        # worker range there could hold one of those ports, and `ray start` refuses such a clash.
        first_worker_port = random.Random().randrange(20000, 32000, 100)
        command = [str(BIN / "ray"), "start", "--block", "--node-ip-address", self.ip,
                   "--disable-usage-stats", "--include-log-monitor=false",  # tests/helpers/local_ray.py: why
                   "--object-store-memory", str(128 << 20),
                   "--min-worker-port", str(first_worker_port),
                   "--max-worker-port", str(first_worker_port + 99),
                   "--resources", json.dumps(resources), *args, *[x for item in ports.items() for x in item]]
        log = self.work_dir / f"{name}.log"
        process = subprocess.Popen(command, env=self.env, cwd=REPO, stdout=log.open("wb"),
                                   stderr=subprocess.STDOUT)
        return RayNode(process, resources, log, ports["--node-manager-port"])

    def start_head(self) -> None:
        """A head with no CPU: the gateway (a driver) runs there, no worker does."""
        self.head = self._start(["--head", "--port", str(self.port), "--num-cpus", "0",
                                 "--temp-dir", str(self.work_dir / "ray"), "--include-dashboard=false"],
                                {}, "head")
        self._wait_started(self.head, "the Ray head")

    def add_node(self, resources: dict[str, float], num_cpus: int = 1, attempts: int = 3) -> RayNode:
        """A worker node, started again (fresh ports) when `ray start` gives up: it waits a fixed 30 s for the
        raylet to register with the GCS, which a loaded 2-core machine can miss (seen in CI)."""
        name = f"node{len(self.nodes)}"
        for attempt in range(1, attempts + 1):
            node = self._start(["--address", self.address, "--num-cpus", str(num_cpus)], resources,
                               name if attempt == 1 else f"{name}-try{attempt}")
            try:
                self._wait_started(node, f"the Ray node {resources}")
            except RuntimeError:
                self._kill_stragglers(node)
                if attempt == attempts:
                    raise
                continue
            self.nodes.append(node)
            return node
        raise AssertionError("unreachable")

    @staticmethod
    def _kill_stragglers(node: RayNode) -> None:
        """A failed start's raylet may outlive `ray start` and register late, a second node with the same
        resources: kill every process started for it, found by its unique node-manager port."""
        kill_tree(node.process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.process.wait(30)
        marker = f"--node_manager_port={node.node_manager_port}"
        for process in psutil.process_iter(["cmdline"]):
            if marker in " ".join(process.info["cmdline"] or []):
                kill_tree(process.pid)

    def kill_node(self, node: RayNode) -> None:
        """The node dies at once: its raylet, its agents and its workers get SIGKILL (a machine lost)."""
        kill_tree(node.process.pid)
        node.process.wait(30)

    def stop(self) -> None:
        for node in [*self.nodes, *([self.head] if self.head else [])]:
            kill_tree(node.process.pid)
            node.process.wait(30)

    def _wait_started(self, node: RayNode, what: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while "Ray runtime started." not in node.log.read_text():  # `ray start` prints it once registered
            if node.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not start; see {node.log}: {node.log.read_text()[-2000:]}")
            time.sleep(0.3)


@contextlib.contextmanager
def running_cluster(prefix: str, *nodes: dict[str, float], num_cpus: int = 1) -> Iterator[LocalRayCluster]:
    """A head and one worker node per resource dict in `nodes` (each with `num_cpus`), all stopped after.
    The work directory is short (`/tmp/<prefix>…`): Ray's socket paths must stay short."""
    work_dir = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    cluster = LocalRayCluster(work_dir)
    try:
        cluster.start_head()
        for resources in nodes:
            cluster.add_node(resources, num_cpus)
        yield cluster
    finally:
        cluster.stop()
        if not os.environ.get("PDSERVE_KEEP_CLUSTER_DIR"):  # set it to read the nodes' Ray logs after a run
            shutil.rmtree(work_dir, ignore_errors=True)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant, children first seen before the parent dies."""
    try:
        root = psutil.Process(pid)
        processes = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
