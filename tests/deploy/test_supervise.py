"""The gateway started the way deploy/ starts it (deploy/supervise.py around `pdserve serve`, joining a Ray
cluster; --api-server-count 2 as on a head) and then hurt: a killed HTTP frontend is started again by the
gateway itself and the workers keep their state (same actors, same processes); a killed gateway process is
started again by the supervisor and rejoins its named fleet (--fleet-name, as deploy/serve.multi-node.yaml
sets): the same workers, their layout as it was changed. A local Ray cluster (tests/cluster/
local_cluster.py) stands for the head's Ray, which outlives the gateway process there too."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.local_cluster import REPO, LocalRayCluster, free_port, kill_tree, running_cluster

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with running_cluster("pds-", {}, num_cpus=2) as ray_cluster:
        yield ray_cluster


def wait_for(what: str, check: Any, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {log.read_text()[-4000:]}"
        time.sleep(0.3)


def serves(url: str) -> bool:
    try:
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def workers(url: str) -> list[tuple[str, int]]:
    pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
    return sorted((w["worker_id"], w["pid"]) for w in pools["workers"] if w["state"] == "active")


def frontends(gateway: psutil.Process) -> list[psutil.Process]:
    """uvicorn's frontend processes: spawned children of the gateway (Ray's own children are not)."""
    found = []
    for process in gateway.children():
        with contextlib.suppress(psutil.Error):  # a killed one not reaped yet is a zombie: not a frontend
            if process.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(process.cmdline()):
                found.append(process)
    return found


def test_a_killed_frontend_or_gateway_comes_back_to_the_same_workers(cluster: LocalRayCluster,
                                                            tiny_chat_model_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = cluster.work_dir / "supervised.log"
    command = [sys.executable, str(REPO / "deploy" / "supervise.py"), "--health-url", f"{url}/health",
               "--check-every-s", "1", "--", sys.executable, "-m", "pdserve", "serve",
               "--address", cluster.address, "--api-server-count", "2", "--model", str(tiny_chat_model_dir),
               "--served-model-name", MODEL, "--mixed", "1", "--kv-cache-mib", "2", "--dtype", "float32",
               "--port", str(port), "--fleet-name", "supervised"]
    supervisor = subprocess.Popen(command, env=cluster.env, cwd=REPO, stdout=log.open("wb"),
                                  stderr=subprocess.STDOUT)
    try:
        wait_for("the gateway", lambda: serves(url), 300, log)
        [gateway] = psutil.Process(supervisor.pid).children()
        before = workers(url)
        assert len(before) == 1 and len(frontends(gateway)) == 2

        # An HTTP frontend dies: the gateway starts another; the fleet and its workers never noticed.
        for frontend in frontends(gateway):
            frontend.kill()
        wait_for("the frontends back", lambda: len(frontends(gateway)) == 2 and serves(url), 120, log)
        assert workers(url) == before and gateway.is_running()

        # The gateway process dies: the supervisor starts it again, and it rejoins the fleet, whose workers
        # carried on (no weights loaded again).
        gateway.kill()
        supervising = psutil.Process(supervisor.pid)
        wait_for("a new gateway", lambda: any(p.pid != gateway.pid for p in supervising.children())
                 and serves(url), 300, log)
        assert workers(url) == before
        assert "supervise: the command ended" in log.read_text()
        assert "rejoined fleet pdserve-fleet-supervised" in log.read_text()
    finally:
        # The supervisor stops the gateway; the named fleet outlives it, until the cluster stops.
        supervisor.send_signal(signal.SIGTERM)
        try:
            assert supervisor.wait(150) is not None
        except subprocess.TimeoutExpired:
            kill_tree(supervisor.pid)
            supervisor.wait()

    # Review N13: stopped on purpose, the named fleet is ended by `pdserve fleet stop`, workers and all.
    def fleet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pdserve", "fleet", *args, "--address", cluster.address],
                              env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=180)

    assert fleet("list").stdout.startswith("supervised\t")
    missing = fleet("stop", "nobody")
    assert missing.returncode == 2 and "no fleet named 'nobody'" in missing.stderr
    assert fleet("stop", "supervised").returncode == 0
    assert "supervised" not in fleet("list").stdout
    [(_, worker_pid)] = before
    deadline = time.monotonic() + 60
    while psutil.pid_exists(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not psutil.pid_exists(worker_pid)
