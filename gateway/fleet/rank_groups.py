"""A tensor-parallel worker's placement group: one bundle per rank, on one node, made with the worker's actor
and given back when the fleet lets the actor go.

    rank_group(config, role, actor name) → the group (named "<actor name>.ranks"); the actor in bundle 0
        (placement.actor_options), its other ranks in bundles 1.. (pool_worker/tp_ranks.py)
    remove_rank_group(actor name) ← WorkerClient.kill, and adoption's kill of a survivor it does not keep
A worker of one rank has none.
"""

from __future__ import annotations

import contextlib

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
