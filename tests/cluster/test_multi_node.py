"""pdserve on a multi-node Ray cluster (tests/helpers/local_cluster.py: a head and two worker nodes, each its
own raylet on this machine): `pdserve serve --address` joins it, prefill and decode workers land on the
nodes that offer their role's resources, the KV crosses nodes (torch group meeting at the first rank's node
IP; NIXL over UCX TCP on the node's interface, not loopback), greedy output equals transformers, and when
the decode node dies mid-stream the gateway reports it, waits for capacity (the fleet actor, on the serving
process's node, lives on; killed then, its restart serves what lives on), and a new decode node restores
service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.helpers.cluster_serving import (
    DECODE,
    MODEL,
    PREFILL,
    greedy_over_http,
    health_is,
    pdserve,
    wait_for,
)
from tests.helpers.local_cluster import REPO, LocalRayCluster, RayNode, running_cluster
from tests.helpers.reference import hf_greedy, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
VOCAB = 49152


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with running_cluster("pdc-", PREFILL, DECODE) as ray_cluster:
        yield ray_cluster


def _is_ok(url: str) -> bool:
    return health_is(url, lambda health: health["status"] == "ok")


def probe(cluster: LocalRayCluster, *args: str) -> dict[str, Any]:
    """Ask the cluster about its nodes and the workers (tests/cluster/probe.py, a second driver)."""
    done = subprocess.run([sys.executable, "-m", "tests.cluster.probe", cluster.address, *args],
                          env=cluster.env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def get_pools(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/admin/pools", timeout=30)
    assert response.status_code == 200, (response.status_code, response.text)
    pools: dict[str, Any] = response.json()
    return pools


def workers_by_role(url: str) -> dict[str, dict[str, Any]]:
    pools = get_pools(url)
    return {w["role"]: w for w in pools["workers"] if w["state"] == "active"}


def node_offering(nodes: list[dict[str, Any]], resource: str) -> set[str]:
    return {n["node_id"] for n in nodes if n["alive"] and resource in n["resources"]}


def check_placed_by_role_and_crossed_nodes(cluster: LocalRayCluster, url: str, backend: str) -> None:
    workers = workers_by_role(url)
    prefill, decode = workers["prefill"], workers["decode"]
    found = probe(cluster, prefill["worker_id"], decode["worker_id"])
    assert prefill["node_id"] in node_offering(found["nodes"], "pdserve_prefill")
    assert decode["node_id"] in node_offering(found["nodes"], "pdserve_decode")
    assert prefill["node_id"] != decode["node_id"]
    assert prefill["node_ip"] == decode["node_ip"] == cluster.ip
    for worker in found["workers"].values():  # the nodes run this worktree, not an installed copy
        assert Path(worker["module_file"]).is_relative_to(REPO), worker["module_file"]
    received = [r for r in found["workers"][decode["worker_id"]]["records"] if r["role"] == "recv"]
    assert received and all(r["backend"] == backend and r["source"] == prefill["worker_id"]
                            and r["outcome"] == "DONE" and r["num_bytes"] > 0 for r in received), found


def test_torch_group_meets_at_the_first_rank_node_ip(cluster: LocalRayCluster,
                                                      tiny_chat_model_dir: Path) -> None:
    prompts = random_prompts([40, 23], VOCAB, seed=71)
    expected = hf_greedy(tiny_chat_model_dir, prompts, 8, ignore_eos=True)
    with pdserve(cluster, tiny_chat_model_dir, "--backend", "torch") as url:
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        assert pools["backend"] == "torch"
        rendezvous = urlparse(pools["torch_rendezvous"])
        rank0 = pools["workers"][0]  # ranks in creation order: the prefill worker first
        assert rendezvous.scheme == "tcp" and rendezvous.hostname == rank0["node_ip"] == cluster.ip
        if cluster.interface != "lo":
            assert not rendezvous.hostname.startswith("127.")
        check_placed_by_role_and_crossed_nodes(cluster, url, "torch")


def stream(url: str, prompt: list[int], max_tokens: int, tokens: list[int], events: list[str]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    with httpx.Client(base_url=url, timeout=300) as client, \
            client.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
            if line.startswith("data: {") and "choices" in line:
                tokens += json.loads(line[6:])["choices"][0]["token_ids"] or []


def test_nixl_across_nodes_then_the_decode_node_dies_and_a_new_one_restores_service(
        cluster: LocalRayCluster, tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("nixl")
    # UCX over TCP on the node's interface: the bytes go to the node's IP, as between machines (on one
    # machine UCX would otherwise pick shared memory).
    worker_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": cluster.interface}
    prompts = random_prompts([40, 23], VOCAB, seed=72)
    expected = hf_greedy(tiny_chat_model_dir, prompts, 8, ignore_eos=True)
    [long_prompt] = random_prompts([30], VOCAB, seed=73)
    long_expected = hf_greedy(tiny_chat_model_dir, [long_prompt], 80, ignore_eos=True)[0]
    with pdserve(cluster, tiny_chat_model_dir, "--backend", "nixl", "--worker-env", json.dumps(worker_env),
                 "--deadline-slack-s", "120") as url:
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
        check_placed_by_role_and_crossed_nodes(cluster, url, "nixl")

        old_decode = workers_by_role(url)["decode"]
        probe(cluster, "--slow", old_decode["worker_id"], "0.1")  # the stream takes ~8 s
        tokens: list[int] = []
        events: list[str] = []
        streaming = threading.Thread(target=stream, args=(url, long_prompt, 80, tokens, events))
        streaming.start()
        wait_for("the stream's first tokens", lambda: len(tokens) >= 3, 60)
        [decode_node] = [n for n in cluster.nodes if n.resources == DECODE and n.process.poll() is None]
        cluster.kill_node(decode_node)

        def is_degraded_with_a_pending_decode_worker() -> bool:
            health = httpx.get(f"{url}/health", timeout=30).json()
            pools = httpx.get(f"{url}/admin/pools", timeout=30)
            if pools.status_code == 503:  # "the fleet is starting again": the API says to try again shortly
                return False
            assert pools.status_code == 200, pools.text
            workers = pools.json()["workers"]
            return health["status"] == "degraded" and health["pending"] == 1 and any(
                w["role"] == "decode" and w["state"] == "pending" and w["node_id"] is None for w in workers)

        wait_for("/health degraded, a decode worker pending", is_degraded_with_a_pending_decode_worker, 60)
        assert old_decode["worker_id"] not in [w["worker_id"] for w in workers_by_role(url).values()]
        # The fleet actor lives on the serving process's node (the head's here), never on the node lost.
        seen = probe(cluster)
        [head] = [n["node_id"] for n in seen["nodes"] if n["alive"] and not n["resources"].get("CPU")]
        [fleet] = [f for f in seen["fleets"] if f["state"] == "ALIVE"]
        assert (fleet["node_id"], fleet["num_restarts"]) == (head, 0), json.dumps(seen, indent=1)
        # Should the fleet actor die now, Ray restarts it and it serves what lives on, the decode worker
        # still pending (not failing every start again until a decode node joins).
        os.kill(fleet["pid"], signal.SIGKILL)
        wait_for("the restarted fleet: degraded, a decode worker pending",
                 is_degraded_with_a_pending_decode_worker, 120)
        assert [f["num_restarts"] for f in probe(cluster)["fleets"] if f["state"] == "ALIVE"] == [1]
        new_node: RayNode = cluster.add_node(DECODE)
        wait_for("/health ok again", lambda: _is_ok(url), 180)
        streaming.join(300)
        assert not streaming.is_alive()
        # The request either moved to the new decode worker and completed (nothing lost or repeated) or ended
        # with a clear error event: never a silent cut.
        print(f"after the node loss: {len(tokens)} tokens, last events {events[-2:]}")
        assert events[-1] == "[DONE]"
        if tokens == long_expected:
            assert not any('"error"' in e for e in events)
        else:
            assert '"error"' in events[-2], events[-3:]
        new_decode = workers_by_role(url)["decode"]
        assert new_decode["node_id"] not in (old_decode["node_id"], None)
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
        check_placed_by_role_and_crossed_nodes(cluster, url, "nixl")
        del new_node


def test_a_worker_without_a_node_at_start_is_pending_until_one_joins(cluster: LocalRayCluster,
                                                                     tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("nixl")
    prompts = random_prompts([33], VOCAB, seed=74)
    expected = hf_greedy(tiny_chat_model_dir, prompts, 8, ignore_eos=True)
    # Two decode workers, one node that offers pdserve_decode: start-up serves with one as soon as it is
    # placed (no live node can take the other: it does not wait out --placement-timeout-s).
    with pdserve(cluster, tiny_chat_model_dir, "--backend", "nixl", "--decode", "2",
                 is_ready=lambda health: health["status"] == "degraded") as url:
        health = httpx.get(f"{url}/health", timeout=30).json()
        assert (health["active_workers"]["decode"], health["pending"]) == (1, 1)
        [pending] = [w for w in get_pools(url)["workers"]
                     if w["state"] == "pending"]
        assert (pending["role"], pending["node_id"]) == ("decode", None)
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
        cluster.add_node(DECODE)
        wait_for("/health ok with both decode workers", lambda: _is_ok(url), 180)
        workers = get_pools(url)["workers"]
        decode_nodes = {w["node_id"] for w in workers if w["role"] == "decode" and w["state"] == "active"}
        assert len(decode_nodes) == 2 and pending["worker_id"] in [w["worker_id"] for w in workers]
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
