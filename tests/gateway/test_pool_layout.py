"""The body of PUT /admin/pools (gateway/ratio/pool_layout.py): counts, degrees, or auto, never both."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.fleet.config import DeploymentConfig
from gateway.ratio.pool_layout import PoolLayout
from llm_engine import EngineConfig
from worker_runtime.roles import Role


def config(**role_tp: int) -> DeploymentConfig:
    return DeploymentConfig(EngineConfig("unused", tensor_parallel_size=1),
                            role_tp={Role(role): tp for role, tp in role_tp.items()})


def test_a_body_without_degrees_keeps_them_and_one_with_a_degree_keeps_the_other_roles() -> None:
    assert PoolLayout(prefill=1, decode=1).role_tp(config(decode=2)) is None
    assert PoolLayout(prefill=1, decode=1, prefill_tp=2).role_tp(config(decode=4)) == {
        Role.PREFILL: 2, Role.DECODE: 4}
    assert PoolLayout(mixed=2, decode_tp=2).role_tp(config()) == {Role.PREFILL: 1, Role.DECODE: 2}


@pytest.mark.parametrize("body", [
    {"prefill": 1, "decode": 1, "prefill_tp": 0},  # a degree is at least 1
    {"prefill": 1, "decode": 1, "decode_tp": 65},
    {"auto": True, "prefill_tp": 2},  # auto sets no degree
    {"decode_tp": 2},  # a degree comes with the counts
    {"prefill": 1, "decode": 1, "prefill_tp": "2"},  # strict: a number
])
def test_bad_bodies_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        PoolLayout(**body)  # type: ignore[arg-type]
