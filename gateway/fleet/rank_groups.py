"""A tensor-parallel worker's placement group: one bundle per rank, on one node, made with the worker's actor
and given back when the fleet lets the actor go.

    rank_group(config, role, actor name) → the group (named "<actor name>.ranks"); the actor in bundle 0
        (placement.actor_options), its other ranks in bundles 1.. (pool_worker/tp_ranks.py)
    remove_rank_group(actor name) ← WorkerClient.kill, and adoption's kill of a survivor it does not keep
    remove_rank_groups_of(keeper, keep) ← adoption (the groups of workers that died while no fleet actor
        watched) and `pdserve fleet stop` (whatever is left under the fleet's name); the worker itself removes
        its group when it exits because its fleet is gone (worker_runtime/keeper_watch.py)
A worker of one rank has none. The group is detached where its worker is (it outlives the fleet actor), so
nothing but these removes it: an orphan would keep tp × (GPU + CPUs) reserved for good (review P4).
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_placement_group,
    placement_group,
    remove_placement_group,
)

from gateway.fleet.config import DeploymentConfig
from worker_runtime.roles import Role


def rank_group(config: DeploymentConfig, role: Role, actor_name: str, detached: bool
               ) -> PlacementGroup | None:
    """A tensor-parallel worker's placement group: one bundle per rank (its CPUs and GPUs; the role's custom
    resources in rank 0's), all on one node (STRICT_PACK), named for the worker's actor. Ray places the
    worker only on a node with room for the whole group, or keeps it pending, with the reason, as any worker.
    None for a worker of one rank. `detached`: it outlives the fleet actor, as the worker does (adoption)."""
    if config.tp_of(role) == 1:
        return None
    return placement_group(rank_bundles(config, role), strategy="STRICT_PACK",
                           name=rank_group_name(actor_name), lifetime="detached" if detached else None)


def rank_bundles(config: DeploymentConfig, role: Role) -> list[dict[str, float]]:
    """A bundle per rank of a worker in `role`: its CPUs and GPUs; the role's custom resources in rank 0's."""
    rank: dict[str, float] = {"CPU": config.num_cpus_per_worker}
    if config.num_gpus_per_worker:
        rank["GPU"] = config.num_gpus_per_worker
    return [{**rank, **config.role_resources.get(role, {})}, *([rank] * (config.tp_of(role) - 1))]


def rank_group_name(actor_name: str) -> str:
    return f"{actor_name}.ranks"


def remove_rank_group(actor_name: str) -> None:
    """Give back the placement group of a worker's ranks (none: nothing to do), once its actor is gone."""
    with contextlib.suppress(Exception):  # none by that name, or removed already
        remove_placement_group(get_placement_group(rank_group_name(actor_name)))


def remove_rank_groups_of(keeper: str, keep: Collection[str] = ()) -> list[str]:
    """Remove every live rank group of a worker kept by `keeper` (named "<keeper>.<digest>.<id>.ranks") but
    those of the actors named in `keep`; returns the removed groups' names."""
    removed = []
    for group in ray.util.placement_group_table().values():
        name = group.get("name") or ""
        if (group.get("state") == "REMOVED" or not name.startswith(f"{keeper}.")
                or not name.endswith(".ranks") or name.removesuffix(".ranks") in keep):
            continue
        remove_rank_group(name.removesuffix(".ranks"))
        removed.append(name)
    return removed
