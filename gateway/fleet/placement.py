"""Where each worker runs: the Ray options that pin a role to nodes, and the wait until Ray has placed it.

    [rank_group(role): a tensor-parallel worker's placement group, a bundle per rank on one node
     (gateway/fleet/rank_groups.py)]
    actor_options(role) → the actor is created, PENDING → Ray places it on a node that offers the role's
    resources (CPUs, GPUs, custom resources such as {"pdserve_decode": 1}) → its constructor answers
    placement() (node id, node IP) → STARTING: it loads the model on that node → ACTIVE
    (gateway/fleet/table.py: create, bring_up).
A worker no node can take stays PENDING as long as that lasts (Ray keeps it queued and places it when a node
with the resources joins; its resource demand is what Ray's autoscaler adds nodes for); /health and
/admin/pools report it, with why (pending_reason). A worker added by PUT /admin/pools waits at most its
placement_deadline, then is given up (its actor killed, so its demand is withdrawn). The torch group meets
on its first rank's node: that node's IP as Ray knows it, and a port free there (never the gateway's
loopback).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.workers import Worker, WorkerState, transition
from worker_runtime.roles import Role

# Ray's own bookkeeping resources: not what an operator gives a node, so not worth listing in an error.
_BOOKKEEPING_PREFIXES = ("node:", "memory", "object_store_memory", "accelerator_type:")


class PlacementTimeout(RuntimeError):
    """Start-up waited its time and the workers Ray placed cannot serve (or a torch group lacks a rank)."""


def actor_options(config: DeploymentConfig, role: Role, name: str, group: PlacementGroup | None = None
                  ) -> dict[str, Any]:
    """Ray options of one worker actor in `role`: a tensor-parallel worker's actor (its rank 0) in the first
    bundle of its `group` (rank_group), its other ranks then in the others (pool_worker/tp_ranks.py)."""
    options: dict[str, Any] = {
        "num_cpus": config.num_cpus_per_worker,
        "num_gpus": config.num_gpus_per_worker,
        "name": name,
        "max_concurrency": 1000,
    }
    resources = config.role_resources.get(role)
    if resources:
        options["resources"] = dict(resources)
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group,
                                                                          placement_group_bundle_index=0)
    if config.worker_env:
        # Ray merges these into the job's environment; a worker with its own env gets its own process.
        options["runtime_env"] = {"env_vars": dict(config.worker_env)}
    return options


def resource_request(config: DeploymentConfig, role: Role) -> dict[str, float]:
    """What one worker in `role` asks Ray for: CPUs, GPUs (if any; both for all its tensor-parallel ranks),
    its role's custom resources."""
    ranks = config.tp_of(role)
    request: dict[str, float] = {"CPU": config.num_cpus_per_worker * ranks,
                                 **config.role_resources.get(role, {})}
    if config.num_gpus_per_worker:
        request["GPU"] = config.num_gpus_per_worker * ranks
    return request


def pending_reason(worker: Worker, config: DeploymentConfig, available: dict[str, float]) -> str:
    """Why a PENDING worker waits, for /admin/pools: what it asks for, what is short in the cluster, and
    until when it waits.

    Args:
        available: ray.available_resources(), read once by the caller for every pending worker.
    """
    request = resource_request(config, worker.role)
    short = {name: available.get(name, 0.0) for name, amount in request.items()
             if amount > available.get(name, 0.0) + 1e-9}
    reason = (f"no node has {request} free (free in the cluster now: {short}); Ray places it as soon as a "
              "node that offers them joins, which Ray's autoscaler starts for this demand if the cluster "
              "autoscales" if short else
              f"asks for {request}: free in the cluster in total, but not on one node, or Ray is placing it")
    if worker.placement_deadline is not None:
        given_up = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(worker.placement_deadline))
        reason += f"; given up as unplaceable at {given_up} (--autoscale-wait-s)"
    return reason


async def wait_placed(worker: Worker, on_placed: Callable[[Worker], None] | None = None) -> None:
    """Wait, however long, until Ray has placed `worker`; then it is STARTING on a known node, and
    `on_placed` is told (once: a worker already placed is not placed again)."""
    placement = await worker.client.placement()
    worker.node_id, worker.node_ip, worker.pid = placement.node_id, placement.node_ip, placement.pid
    if worker.state is WorkerState.PENDING:
        transition(worker, WorkerState.STARTING)
        if on_placed is not None:
            on_placed(worker)


def fit_no_live_node(unplaced: list[Worker], placed: list[Worker], config: DeploymentConfig,
                     nodes: list[dict[str, Any]] | None = None) -> bool:
    """Whether no live node can take any of `unplaced` as the cluster stands: on each node, its total
    resources less what the fleet's own `placed` workers hold there fall short of every one's request. Only
    a node joining changes that (Ray keeps them queued for one), so there is nothing to wait for now. Other
    jobs' actors are not subtracted, and a worker Ray has placed but whose constructor has not answered yet
    counts as unplaced: both keep the answer False where in doubt. `nodes`: ray.nodes() (read if None)."""
    held: dict[str, Counter[str]] = {}
    for worker in placed:
        held.setdefault(str(worker.node_id), Counter()).update(resource_request(config, worker.role))
    requests = [resource_request(config, worker.role) for worker in unplaced]
    for node in ray.nodes() if nodes is None else nodes:
        if not node.get("Alive"):
            continue
        total, taken = node.get("Resources", {}), held.get(node["NodeID"], Counter())
        if any(all(total.get(name, 0.0) - taken[name] >= amount - 1e-9 for name, amount in request.items())
               for request in requests):
            return False
    return True


async def wait_all_placed(workers: list[Worker], timeout_s: float,
                          on_placed: Callable[[Worker], None] | None = None,
                          nothing_to_wait_for: Callable[[], bool] | None = None) -> float:
    """Wait until Ray has placed every worker, `timeout_s` has passed, or `nothing_to_wait_for()` says the
    rest cannot be placed until the cluster changes (asked twice a second); returns the seconds waited.
    `on_placed` is told of each as it is placed.

    Raises:
        Exception: an actor Ray could not create at all (its constructor failed).
    """
    started = time.monotonic()
    if not workers:  # a restarted fleet that adopted every worker (gateway/fleet/adoption.py)
        return 0.0
    placing = [asyncio.ensure_future(wait_placed(w, on_placed)) for w in workers]
    deadline = started + timeout_s
    while not all(future.done() for future in placing) and time.monotonic() < deadline:
        await asyncio.wait(placing, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        if nothing_to_wait_for is not None and nothing_to_wait_for():
            break
    for future in placing:
        if future.done():
            future.result()
        else:
            future.cancel()  # the actor stays queued in Ray; only this wait ends
    return time.monotonic() - started


async def torch_rendezvous(first_rank: Worker) -> str:
    """The torch group's init address: the first rank's node IP and a port free on that node."""
    port = await first_rank.client.free_port()
    host = f"[{first_rank.node_ip}]" if ":" in str(first_rank.node_ip) else first_rank.node_ip  # IPv6
    return f"tcp://{host}:{port}"


def describe_unplaced(unplaced: list[Worker], config: DeploymentConfig, waited_s: float,
                      fit_no_node: bool = False) -> str:
    """A message for the operator: what could not be placed, what it asks for, what the cluster offers.
    `fit_no_node`: the wait ended early because no live node can take them (fit_no_live_node)."""
    counts = Counter(w.role for w in unplaced)
    asks = [f"{count} {role.value} worker(s), each asking for {resource_request(config, role)}"
            for role, count in counts.items()]
    offers = []
    for node in ray.nodes():
        if node.get("Alive"):
            offered = {k: v for k, v in node.get("Resources", {}).items()
                       if not k.startswith(_BOOKKEEPING_PREFIXES)}
            offers.append(f"{node.get('NodeManagerAddress')} {offered}")
    said = (f"no live node can take {'; '.join(asks)} beside the workers placed" if fit_no_node else
            f"no node took {'; '.join(asks)} within {waited_s:.0f} s")
    return (f"{said}. Live nodes and their resources (total, not free): {'; '.join(offers) or 'none'}. "
            "Start nodes that offer them (ray start --resources '{\"pdserve_decode\": 1}' ...), lower the "
            "worker counts, or change --prefill-resources / --decode-resources / --mixed-resources"
            + ("." if fit_no_node else " (a longer wait: --placement-timeout-s)."))
