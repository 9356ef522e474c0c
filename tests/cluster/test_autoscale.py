"""Scale-out through an autoscaler, on a local multi-node Ray cluster (tests/helpers/local_cluster.py):
`pdserve serve --autoscale-wait-s` accepts a layout that needs a node not there yet; the new worker waits
pending (its resource demand is what Ray's autoscaler would add a node for) and GET /admin/pools says why;
once a node that offers its resources joins (here started by hand, as the autoscaler would), the layout
completes and serves. A worker no node takes within the wait (the change's own placement_wait_s here) is
given up as unplaceable: the PUT answers why, its actor is gone and the layout is what it was."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers.cluster_serving import DECODE, PREFILL, greedy_over_http, pdserve, wait_for
from tests.helpers.local_cluster import LocalRayCluster, running_cluster
from tests.helpers.reference import hf_greedy, random_prompts

pytestmark = [pytest.mark.slow, pytest.mark.cluster]
VOCAB = 49152
# Long enough for `ray start` of a node on a loaded machine.
AUTOSCALE_WAIT_S = 90
GIVE_UP_WAIT_S = 15  # the last change's own wait (PUT /admin/pools placement_wait_s): no node comes


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRayCluster]:
    with running_cluster("pda-", PREFILL, DECODE) as ray_cluster:
        yield ray_cluster


def put_in_background(url: str, layout: dict[str, float]) -> tuple[threading.Thread, list[httpx.Response]]:
    """PUT /admin/pools answers once the change is done: it runs in a thread while the test looks on."""
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(
        httpx.put(f"{url}/admin/pools", json=layout, timeout=AUTOSCALE_WAIT_S + 240)), daemon=True)
    thread.start()
    return thread, answers


def test_a_layout_that_needs_a_new_node_waits_pending_then_completes_or_is_given_up(
        cluster: LocalRayCluster, tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("nixl")
    worker_env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": cluster.interface}
    prompts = random_prompts([31, 17], VOCAB, seed=91)
    expected = hf_greedy(tiny_chat_model_dir, prompts, 8, ignore_eos=True)
    with pdserve(cluster, tiny_chat_model_dir, "--backend", "nixl", "--worker-env", json.dumps(worker_env),
                 "--autoscale-wait-s", str(AUTOSCALE_WAIT_S)) as url:
        # Without the setting this layout is refused (tests/gateway/test_resize.py): no CPU is free for it.
        thread, answers = put_in_background(url, {"prefill": 1, "decode": 2})

        def pending_decode() -> list[dict[str, object]]:
            workers = httpx.get(f"{url}/admin/pools", timeout=30).json()["workers"]
            return [w for w in workers if w["role"] == "decode" and w["state"] == "pending"]

        wait_for("a pending decode worker", lambda: len(pending_decode()) == 1, 120)
        [pending] = pending_decode()
        reason = str(pending["pending_reason"])
        assert "'pdserve_decode': 1.0" in reason and "autoscaler" in reason and "given up" in reason, reason
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        assert pools["change_in_progress"] is not None and pools["pending"] == 1
        # /health reads the frontend's mirror of the fleet, a snapshot behind /admin/pools (the fleet actor's
        # own answer) by up to one report.
        wait_for("/health to count the pending worker",
                 lambda: httpx.get(f"{url}/health", timeout=30).json()["pending"] == 1, 10)
        assert thread.is_alive()  # the PUT waits for the node

        cluster.add_node(DECODE)  # what the autoscaler does for the demand
        thread.join(AUTOSCALE_WAIT_S + 240)
        [answer] = answers
        assert answer.status_code == 200 and answer.json()["error"] == "", answer.text
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        decodes = [w for w in pools["workers"] if w["role"] == "decode" and w["state"] == "active"]
        assert len(decodes) == 2 and len({w["node_id"] for w in decodes}) == 2 and pools["pending"] == 0
        for _ in range(2):  # both decode workers take requests (the router spreads them)
            assert [greedy_over_http(url, p, 8) for p in prompts] == expected

        # No third decode node comes: after the change's wait the worker is given up and the layout stays as
        # it was.
        before = {w["worker_id"] for w in pools["workers"]}
        third = {"prefill": 1, "decode": 3, "placement_wait_s": GIVE_UP_WAIT_S}
        thread, answers = put_in_background(url, third)
        wait_for("a pending decode worker", lambda: len(pending_decode()) == 1, 120)
        [given_up] = pending_decode()
        thread.join(AUTOSCALE_WAIT_S + 240)
        [answer] = answers
        assert answer.status_code == 200, answer.text
        assert "PlacementTimeout" in answer.json()["error"] and "unplaceable" in answer.json()["error"]
        assert f"within {GIVE_UP_WAIT_S:g} s" in answer.json()["error"], answer.json()["error"]
        pools = httpx.get(f"{url}/admin/pools", timeout=30).json()
        assert {w["worker_id"] for w in pools["workers"]} == before
        assert given_up["worker_id"] not in {w["worker_id"] for w in pools["workers"]}
        assert pools["target"] == {"prefill": 1, "decode": 2, "mixed": 0} and pools["pending"] == 0
        assert [greedy_over_http(url, p, 8) for p in prompts] == expected
