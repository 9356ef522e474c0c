"""`pdserve serve` as its own process joining a local multi-node cluster (tests/helpers/local_cluster.py),
the prefill and decode nodes told apart by a custom resource, and the HTTP calls the cluster suites make."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.local_cluster import REPO, LocalRayCluster, free_port, kill_tree

MODEL = "tiny"
PREFILL = {"pdserve_prefill": 1.0}
DECODE = {"pdserve_decode": 1.0}


@contextlib.contextmanager
def pdserve(cluster: LocalRayCluster, model_dir: Path, *args: str,
            is_ready: Callable[[dict[str, Any]], bool] = lambda health: health["status"] == "ok",
            ) -> Iterator[str]:
    """`pdserve serve --address` joining the cluster, as its own process (a driver on the head's machine)."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve", "serve", "--address", cluster.address, "--model",
               str(model_dir), "--served-model-name", MODEL, "--port", str(port), "--prefill", "1",
               "--decode", "1", "--prefill-resources", json.dumps(PREFILL), "--decode-resources",
               json.dumps(DECODE), "--kv-cache-mib", "2", "--max-num-batched-tokens", "256",
               "--dtype", "float32", *args]
    log = cluster.work_dir / f"serve-{port}.log"
    server = subprocess.Popen(command, env=cluster.env, cwd=REPO, stdout=log.open("wb"),
                              stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while not health_is(url, is_ready):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve serve did not come up: {log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    except BaseException:  # the test failed: what the server printed is the first thing to read
        print(f"--- pdserve serve's log ({log}), its tail ---\n{log.read_text()[-12000:]}", file=sys.stderr)
        raise
    finally:
        server.send_signal(signal.SIGINT)  # the gateway shuts its workers down
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            kill_tree(server.pid)
            server.wait()


def health_is(url: str, check: Callable[[dict[str, Any]], bool]) -> bool:
    try:
        return check(httpx.get(f"{url}/health", timeout=5).json())
    except (httpx.HTTPError, ValueError):
        return False


def greedy_over_http(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def wait_for(what: str, check: object, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
