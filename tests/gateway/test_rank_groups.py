"""Review P4: a tensor-parallel worker's placement group is detached (it outlives the fleet actor, as the
worker does), so a worker that died while no fleet actor watched left it reserving its ranks' resources for
good. Adoption and `pdserve fleet stop` remove every rank group under the fleet's name but those of the
workers kept (real placement groups on the suite's local Ray)."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table

from gateway.fleet.rank_groups import remove_rank_group, remove_rank_groups_of


def group_state(name: str) -> str:
    states = [g["state"] for g in placement_group_table().values() if g["name"] == name]
    return states[-1] if states else "none"


def test_the_rank_groups_of_workers_no_fleet_keeps_are_removed(ray_local: None) -> None:
    names = ["pdserve-fleet-t1.d1.worker-a", "pdserve-fleet-t1.d1.worker-b", "pdserve-fleet-t1.d0.worker-c",
             "pdserve-fleet-t10.d1.worker-d"]  # the last: another fleet whose name starts alike
    groups = [placement_group([{"CPU": 0.01}], name=f"{n}.ranks", lifetime="detached") for n in names]
    ray.get([g.ready() for g in groups])
    try:
        removed = remove_rank_groups_of("pdserve-fleet-t1", keep=["pdserve-fleet-t1.d1.worker-a"])
        assert sorted(removed) == [f"{names[2]}.ranks", f"{names[1]}.ranks"]
        assert [group_state(f"{n}.ranks") for n in names] == ["CREATED", "REMOVED", "REMOVED", "CREATED"]
        assert remove_rank_groups_of("pdserve-fleet-t1", keep=["pdserve-fleet-t1.d1.worker-a"]) == []
    finally:
        for name in names:
            remove_rank_group(name)
