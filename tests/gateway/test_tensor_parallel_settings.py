"""Tensor-parallel settings: bad degrees refused naming the flag, and a layout never moves a worker in place
between roles of different degrees (a worker's ranks are fixed at its start)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ServeConfig
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.placement import actor_options, pending_reason
from gateway.fleet.rank_groups import rank_bundles
from gateway.fleet.workers import Worker, WorkerState
from gateway.ratio.resize import Move, plan_moves
from llm_engine import EngineConfig
from worker_runtime.roles import Role


@pytest.mark.parametrize(("flags", "named"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"decode_tp": 0}, "decode_tp"),
    ({"tensor_parallel_size": 3}, "--tensor-parallel-size 3 does not split the model's 8 attention heads"),
    ({"prefill_tp": 2, "decode_tp": 3}, "--decode-tp 3 does not split"),
    ({"prefill_tp": 2, "ratio": "auto"}, "--prefill-tp 2 / --decode-tp 1: --ratio auto moves workers"),
])
def test_bad_tensor_parallel_settings_are_refused_naming_the_flag(
        tiny_chat_model_dir: Path, flags: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ServeConfig(model=str(tiny_chat_model_dir), **flags)  # type: ignore[arg-type]


def test_a_layout_adds_and_drains_rather_than_change_a_worker_between_degrees() -> None:
    current = {Role.PREFILL: 1, Role.DECODE: 2, Role.MIXED: 0}
    target = {Role.PREFILL: 2, Role.DECODE: 1, Role.MIXED: 0}
    degree = {Role.PREFILL: 1, Role.DECODE: 2, Role.MIXED: 2}
    assert plan_moves(current, target) == [Move("change", Role.PREFILL, Role.DECODE)]
    assert plan_moves(current, target, lambda a, b: degree[a] == degree[b]) == [
        Move("add", Role.PREFILL), Move("drain", Role.DECODE)]


def test_a_tensor_parallel_worker_asks_ray_for_all_its_ranks_and_says_so_while_pending() -> None:
    """A bundle per rank, the role's resources in rank 0's, each rank's actor its own share: Ray places the
    worker only on a node where the group fits, and a worker no node can take is pending with the group's
    demand as its reason."""
    engine = EngineConfig("unused", device="cpu", tensor_parallel_size=1)
    config = DeploymentConfig(engine, num_prefill=1, num_decode=1, num_cpus_per_worker=1.5,
                              role_tp={Role.DECODE: 2}, role_resources={Role.DECODE: {"pdserve_decode": 1}})
    assert actor_options(config, Role.PREFILL, "p")["num_cpus"] == 1.5
    assert actor_options(config, Role.DECODE, "d")["num_cpus"] == 1.5  # rank 0's bundle
    assert rank_bundles(config, Role.DECODE) == [{"CPU": 1.5, "pdserve_decode": 1}, {"CPU": 1.5}]
    assert rank_bundles(config, Role.PREFILL) == [{"CPU": 1.5}]
    assert config.engine_for(Role.MIXED).tensor_parallel_size == 2  # a mixed worker takes the decode degree
    pending = Worker("worker-x-1", Role.DECODE, None, state=WorkerState.PENDING)  # type: ignore[arg-type]
    reason = pending_reason(pending, config, {"CPU": 2.0})
    assert "no node has {'CPU': 3.0, 'pdserve_decode': 1} free" in reason, reason
