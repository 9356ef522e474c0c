"""Placement settings and what the gateway does with workers Ray cannot place yet (one local Ray instance).

A worker no node can take is PENDING: start-up waits until no live node can take it beside the workers
placed (or placement_timeout_s), then serves with what was placed (/health degraded, /admin/pools shows it
pending) if that can serve, else fails with a message naming what no node offers. Settings come from flags
or YAML; a model missing on a node is named with the node.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import ServeConfig
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.placement import PlacementTimeout, fit_no_live_node
from gateway.fleet.workers import Worker, WorkerState
from gateway.serve_settings import deployment_config
from tests.helpers.servers import API_KEY, MODEL, serve_config, serving
from worker_runtime.model_source import ModelSource
from worker_runtime.roles import Role


def test_role_resources_gpus_and_worker_env_reach_the_deployment(tiny_llama_dir: Path) -> None:
    config = ServeConfig(dtype="float32", model=str(tiny_llama_dir), prefill_resources={"pdserve_prefill": 1},
                         decode_resources={"pdserve_decode": 0.5}, gpus_per_worker=0.5,
                         worker_env={"UCX_NET_DEVICES": "mlx5_0:1"}, placement_timeout_s=7)
    deployment = deployment_config(config, str(tiny_llama_dir))
    assert deployment.role_resources == {Role.PREFILL: {"pdserve_prefill": 1.0},
                                         Role.DECODE: {"pdserve_decode": 0.5}}
    assert (deployment.num_gpus_per_worker, deployment.placement_timeout_s) == (0.5, 7.0)
    assert deployment.worker_env == {"UCX_NET_DEVICES": "mlx5_0:1"}
    assert deployment.model_source == ModelSource(str(tiny_llama_dir))
    assert deployment_config(ServeConfig(), str(tiny_llama_dir)).model_source == ModelSource(None)
    with pytest.raises(ValueError, match="CPU/GPU per worker"):
        deployment_config(ServeConfig(decode_resources={"GPU": 1}), str(tiny_llama_dir))
    with pytest.raises(ValidationError):
        ServeConfig(decode_resources={"pdserve_decode": "many"})  # type: ignore[dict-item]


def test_resource_flags_take_json_and_name_the_flag_when_it_is_not(
        capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.main import build_parser

    args = build_parser().parse_args(["serve", "--decode-resources", '{"pdserve_decode": 1}',
                                      "--worker-env", '{"UCX_TLS": "tcp"}', "--gpus-per-worker", "0.5"])
    assert (args.decode_resources, args.worker_env, args.gpus_per_worker) == (
        {"pdserve_decode": 1}, {"UCX_TLS": "tcp"}, 0.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--decode-resources", "pdserve_decode=1"])
    assert "--decode-resources: invalid json_object value" in capsys.readouterr().err


def test_a_model_missing_on_a_node_is_named_with_the_node(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"not on node 10\.0\.0\.3 \(node id 5f2c\)"):
        ModelSource(str(tmp_path / "nowhere")).resolve_here("10.0.0.3 (node id 5f2c)")
    (tmp_path / "config.json").write_text("{}")
    assert ModelSource(str(tmp_path)).resolve_here("here") == str(tmp_path)


def test_start_up_stops_waiting_only_when_no_live_node_can_take_the_rest(tiny_llama_dir: Path) -> None:
    """Each node's total resources less what the fleet's placed workers hold there: a worker that fits
    there may still be placed (wait); one that fits nowhere waits for a node to join (do not)."""
    config = deployment_config(serve_config(tiny_llama_dir, cpus_per_worker=1.5,
                                            decode_resources={"pdserve_decode": 1}), str(tiny_llama_dir))

    def worker(role: Role, node_id: str | None = None) -> Worker:
        state = WorkerState.PENDING if node_id is None else WorkerState.STARTING
        return Worker(f"{role.value}-{node_id}", role, None, state, node_id=node_id)  # type: ignore[arg-type]

    def node(node_id: str, alive: bool = True, **resources: float) -> dict[str, object]:
        return {"NodeID": node_id, "Alive": alive, "Resources": resources}

    head = node("a", CPU=4.0)
    decode_node = node("b", CPU=2.0, pdserve_decode=1.0)
    prefill, decode = worker(Role.PREFILL, "a"), worker(Role.DECODE, "b")
    # A second decode worker: node b's one pdserve_decode is held by the first, node a offers none.
    assert fit_no_live_node([worker(Role.DECODE)], [prefill, decode], config, [head, decode_node])
    # Before the first decode worker is placed, it and the second might both go to b: wait.
    assert not fit_no_live_node([worker(Role.DECODE)] * 2, [prefill], config, [head, decode_node])
    # A prefill worker of 1.5 CPUs: 4 − 1.5 on node a leave room; with two there, 1 CPU does not.
    assert not fit_no_live_node([worker(Role.PREFILL)], [prefill], config, [head, decode_node])
    assert fit_no_live_node([worker(Role.PREFILL)], [prefill, worker(Role.PREFILL, "a")], config,
                            [head, node("b", CPU=1.0)])
    # A dead node takes nothing; a node joining with room does.
    assert fit_no_live_node([worker(Role.DECODE)], [prefill, decode], config,
                            [head, decode_node, node("c", alive=False, CPU=2.0, pdserve_decode=1.0)])
    assert not fit_no_live_node([worker(Role.DECODE)], [prefill, decode], config,
                                [head, decode_node, node("c", CPU=2.0, pdserve_decode=1.0)])


@pytest.mark.usefixtures("ray_local")
def test_a_worker_no_node_can_take_is_pending_and_the_rest_serve(tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("nixl")
    # The local Ray instance has 4 CPUs: two workers of 1.5 fit, the third waits for a node that never comes.
    # Start-up does not wait out its placement timeout (5 minutes, past serving()'s 2 for the start) for it:
    # beside the two placed, no node can take it.
    config = serve_config(tiny_chat_model_dir, backend="nixl", prefill=1, decode=2, cpus_per_worker=1.5)
    with serving(config) as (url, _), httpx.Client(base_url=url, timeout=60,
                                                   headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        health = client.get("/health")
        assert health.status_code == 200
        assert (health.json()["status"], health.json()["pending"]) == ("degraded", 1)
        workers = client.get("/admin/pools").json()["workers"]
        [pending] = [w for w in workers if w["state"] == "pending"]
        assert pending["node_id"] is None and "requests" not in pending
        assert all(w["node_id"] for w in workers if w["state"] == "active")
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
        assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.usefixtures("ray_local")
def test_start_fails_naming_what_no_node_offers(tiny_chat_model_dir: Path) -> None:
    pytest.importorskip("nixl")
    config = serve_config(tiny_chat_model_dir, backend="nixl", decode_resources={"pdserve_decode": 1},
                          placement_timeout_s=1)
    deployment = PDDeployment(deployment_config(config, str(tiny_chat_model_dir)))

    async def start_then_shut_down() -> None:
        try:
            await deployment.start()
        finally:
            await deployment.shutdown()

    with pytest.raises(PlacementTimeout) as failed:
        asyncio.run(start_then_shut_down())
    message = str(failed.value)
    assert "1 decode worker(s), each asking for {'CPU': 1.0, 'pdserve_decode': 1.0}" in message
    assert "Live nodes and their resources" in message and "--decode-resources" in message
