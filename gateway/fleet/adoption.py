"""A fleet actor that Ray restarted adopts the workers its predecessor left running, weights and streams and
all, instead of loading the model again.

The workers of a fleet kept by a named actor (the FleetActor, gateway/control/fleet_actor.py) are detached Ray
actors named "<keeper>.<settings digest>.<worker id>" (gateway/fleet/table.py creates them): they outlive the
fleet actor's death, and each ends itself once no actor bears the keeper's name for a while
(worker_runtime/keeper_watch.py).

    survivors(keeper): the live actors of that prefix in this namespace; those started under other settings
      (a fleet replaced by one with other settings, whose shutdown did not end them) are killed
    → each asked standing() within STANDING_TIMEOUT_S
    → one that serves, with a live step loop, becomes an ACTIVE Worker in the new deployment's table
      (WorkerTable.add): its role, node, process and cores as it reports them (its own id, so the frontends'
      mirrors, which key workers by id, keep their clients and the streams open on it)
    → any other (not started, between two roles, not answering, step loop dead) is killed: the deployment
      starts a new one in its place if its layout misses it.
The deployment then wires every adopted worker again (PeerWiring's generations come from the clock, above
any its predecessor sent) and sets its target from what it adopted (gateway/fleet/deployment.py start()).
A torch group binds its ranks at start: such a fleet adopts nothing (the survivors are killed, the fleet
starts anew).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, cast

import ray

from gateway.fleet.rank_groups import remove_rank_group, remove_rank_groups_of
from gateway.fleet.table import worker_actor_name
from gateway.fleet.worker_client import WorkerClient
from gateway.fleet.workers import Worker, WorkerState
from worker_runtime.info import WorkerStanding
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from gateway.fleet.table import WorkerTable
    from pool_worker.actor import WorkerActor

logger = logging.getLogger(__name__)

STANDING_TIMEOUT_S = 15.0  # a survivor that cannot say who it is in this long is not adopted


def worker_actor(worker_id: str) -> ActorHandle[WorkerActor]:
    """The live actor of a worker, by its id, whoever keeps it (for operators' tools and fault injection).

    Raises:
        ValueError: no live actor of that worker in this Ray namespace.
    """
    for name in ray.util.list_named_actors():
        if name == f"pdserve-{worker_id}" or name.rsplit(".", 1)[-1] == worker_id:
            return cast("ActorHandle[WorkerActor]", ray.get_actor(name))
    raise ValueError(f"no live actor of worker {worker_id}")


def survivors(keeper: str, digest: str) -> dict[str, ActorHandle[WorkerActor]]:
    """Worker id → handle of each live worker actor named under `keeper` and `digest` in this Ray namespace;
    one under `keeper` with another digest is killed."""
    found: dict[str, ActorHandle[WorkerActor]] = {}
    for name in ray.util.list_named_actors():
        parts = name.rsplit(".", 2)  # the keeper's own name may hold dots; the digest and the id do not
        if len(parts) != 3 or parts[0] != keeper:
            continue
        started_under, worker_id = parts[1], parts[2]
        try:
            handle = cast("ActorHandle[WorkerActor]", ray.get_actor(name))
        except ValueError:  # died between the listing and the lookup
            continue
        if started_under == digest:
            found[worker_id] = handle
        else:
            logger.warning("a surviving worker %s was started under other settings: killed", worker_id)
            ray.kill(handle, no_restart=True)
            remove_rank_group(name)
    return found


async def adopt_survivors(table: WorkerTable, keeper: str) -> list[Worker]:
    """Add the survivors that serve to `table` as ACTIVE workers (not yet wired); kill the others."""
    handles = survivors(keeper, table.digest)
    if not handles:
        _remove_orphan_rank_groups(keeper, [])
        return []
    standings = await asyncio.gather(*(_standing(handle) for handle in handles.values()))
    adopted: list[Worker] = []
    for (worker_id, handle), standing in zip(handles.items(), standings, strict=True):
        name = worker_actor_name(keeper, table.digest, worker_id)
        if standing is None or not table.can_change:
            ray.kill(handle, no_restart=True)
            remove_rank_group(name)
            continue
        info, placement = standing.info, standing.placement
        worker = Worker(worker_id, info.role, WorkerClient(worker_id, handle, table.gateway_id, name),
                        state=WorkerState.ACTIVE, node_id=placement.node_id, node_ip=placement.node_ip,
                        pid=placement.pid, cpu_slot=standing.cpu_slot, runtime=info.runtime,
                        tp=info.runtime.tensor_parallel_size if info.runtime else 1)
        table.add(worker)
        adopted.append(worker)
    logger.info("adopted %d of %d surviving workers: %s", len(adopted), len(handles),
                ", ".join(f"{w.worker_id} ({w.role.value})" for w in adopted))
    kept = [worker_actor_name(keeper, table.digest, w.worker_id) for w in adopted]
    _remove_orphan_rank_groups(keeper, kept)
    return adopted


def _remove_orphan_rank_groups(keeper: str, adopted: list[str]) -> None:
    """The rank groups of workers that died while no fleet actor watched (none adopts them) go back."""
    for name in remove_rank_groups_of(keeper, keep=adopted):
        logger.warning("removed the placement group %s: its worker is gone", name)


def layout_after_adoption(layout: dict[Role, int], adopted: list[Role]) -> dict[Role, int]:
    """The target of a deployment that adopted workers in `adopted` roles: those roles (the layout the
    previous fleet actor had reached, by PUTs or the ratio controller), plus, where it adopted fewer workers
    than `layout` counts, the missing ones in the roles `layout` lacks most."""
    target = {role: sum(r is role for r in adopted) for role in Role}
    for _ in range(sum(layout.values()) - len(adopted)):
        role = max(Role, key=lambda r: layout[r] - target[r])
        target[role] += 1
    return target


def adopted_degrees(adopted: list[tuple[Role, int]]) -> dict[Role, int]:
    """The tensor-parallel degree per role (Role.DECODE's holds for mixed workers too) that the adopted
    workers, given as (role, degree), all run at: a restarted fleet actor starts its missing workers at the
    degrees a PUT had set before the restart, not the start's (review LOW). A role whose workers disagree
    (a change cut short) or that has none is left out."""
    by_role: dict[Role, set[int]] = {}
    for role, degree in adopted:
        by_role.setdefault(Role.DECODE if role is Role.MIXED else role, set()).add(degree)
    return {role: next(iter(degrees)) for role, degrees in by_role.items() if len(degrees) == 1}


async def _standing(handle: ActorHandle[WorkerActor]) -> WorkerStanding | None:
    """The survivor's standing if it serves with a live step loop, else None."""
    try:
        standing: WorkerStanding = await asyncio.wait_for(handle.standing.remote(), STANDING_TIMEOUT_S)
        if not standing.is_serving:
            return None
        load = await asyncio.wait_for(handle.load.remote(), STANDING_TIMEOUT_S)
    except Exception as error:  # dead, hung, or from an older build without standing()
        logger.warning("a surviving worker did not answer (%s): not adopted", type(error).__name__)
        return None
    return None if load.failure else standing
