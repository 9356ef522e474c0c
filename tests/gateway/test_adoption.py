"""A fleet actor that Ray restarted adopts its predecessor's workers (gateway/fleet/adoption.py); a worker
whose fleet actor is gone for good ends itself (worker_runtime/keeper_watch.py). The whole path (the fleet
actor SIGKILLed under two frontends, its streams finishing whole on the same worker processes) is
tests/gateway/test_frontends.py's."""

from __future__ import annotations

import threading
import time

import pytest
import ray

from gateway.fleet.adoption import adopted_degrees, layout_after_adoption, survivors, worker_actor
from gateway.fleet.table import worker_actor_name
from worker_runtime.keeper_watch import KeeperWatch
from worker_runtime.roles import Role

P, D, M = Role.PREFILL, Role.DECODE, Role.MIXED


def layout(prefill: int = 0, decode: int = 0, mixed: int = 0) -> dict[Role, int]:
    return {P: prefill, D: decode, M: mixed}


def test_the_target_after_adoption_keeps_the_roles_the_fleet_had_reached() -> None:
    # The controller had turned 1P+1D into 2 mixed: the restart keeps that, and starts nothing.
    assert layout_after_adoption(layout(1, 1), [M, M]) == layout(mixed=2)
    # A worker was starting when the fleet died (not adopted): the role the layout lacks most is filled.
    assert layout_after_adoption(layout(1, 2), [D, D]) == layout(1, 2)
    assert layout_after_adoption(layout(1, 1), [P]) == layout(1, 1)
    # More survivors than the layout counts (a PUT had grown the fleet): every one is kept.
    assert layout_after_adoption(layout(1, 1), [P, D, D]) == layout(1, 2)


def test_a_restart_starts_its_missing_workers_at_the_degrees_its_workers_run() -> None:
    """Review LOW: a PUT had set the decode degree to 2, then the fleet actor restarted: the workers it
    starts must be of the degree its adopted ones run at, not the start's. Mixed workers share decode's."""
    assert adopted_degrees([(P, 1), (D, 2), (M, 2)]) == {P: 1, D: 2}
    assert adopted_degrees([(P, 1), (P, 2), (D, 2)]) == {D: 2}  # prefill disagrees (a change cut short)
    assert adopted_degrees([]) == {}


@ray.remote(num_cpus=0)
class Named:
    def ping(self) -> bool:
        return True


def test_a_worker_ends_itself_only_once_its_keeper_is_gone_for_good(ray_local: None) -> None:
    keeper = Named.options(name="keeper-under-test", max_restarts=1).remote()  # type: ignore[attr-defined]
    ray.get(keeper.ping.remote())
    gone = threading.Event()
    watch = KeeperWatch("keeper-under-test", on_gone=gone.set, check_s=0.1, gone_s=1.0).start()
    try:
        time.sleep(1.5)
        assert not gone.is_set()
        ray.kill(keeper, no_restart=False)  # Ray restarts it under the same name: not gone
        time.sleep(1.5)
        assert not gone.is_set()
        ray.kill(keeper, no_restart=True)
        assert gone.wait(10), "the worker did not notice its keeper had died for good"
    finally:
        watch.stop()


def test_survivors_of_other_settings_are_killed_not_adopted(ray_local: None) -> None:
    keeper = "fleet.with.dots"
    same = Named.options(name=worker_actor_name(keeper, "abc", "worker-1-0"),  # type: ignore[attr-defined]
                         lifetime="detached").remote()
    other = Named.options(name=worker_actor_name(keeper, "def", "worker-1-1"),  # type: ignore[attr-defined]
                          lifetime="detached").remote()
    stranger = Named.options(name=worker_actor_name("fleet", "with", "worker-2-0"),  # type: ignore[attr-defined]
                             lifetime="detached").remote()
    ray.get([same.ping.remote(), other.ping.remote(), stranger.ping.remote()])
    try:
        assert list(survivors(keeper, "abc")) == ["worker-1-0"]
        assert ray.get(worker_actor("worker-2-0").ping.remote())  # found by its id, whoever keeps it
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(other.ping.remote(), timeout=30)
        assert ray.get(stranger.ping.remote())  # another keeper's ("fleet"): left alone
    finally:
        for actor in (same, stranger):
            ray.kill(actor)
