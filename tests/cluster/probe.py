"""A short-lived Ray driver that looks inside a running `pdserve serve` on a cluster, for the tests.

    python -m tests.cluster.probe ADDRESS [WORKER_ID ...] [--slow WORKER_ID SECONDS] [--heal WORKER_ID]
prints JSON: the cluster's nodes (id, alive, resources), the fleet actors (node, restarts), and for each
worker the file its `pool_worker` was imported from (so a test can check the nodes run this worktree) and its
transfer records. The gateway joins a cluster in the "pdserve" namespace, so its actors are found by name.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import ray

from gateway.fleet.adoption import worker_actor


def _module_file(actor: Any) -> str:
    return str(sys.modules["pool_worker"].__file__)


def main(argv: list[str]) -> None:
    address, *rest = argv
    slow: dict[str, float] = {}
    if "--slow" in rest:
        at = rest.index("--slow")
        slow[rest[at + 1]] = float(rest[at + 2])
        rest = rest[:at] + rest[at + 3:]
    heal: list[str] = []
    if "--heal" in rest:
        at = rest.index("--heal")
        heal.append(rest[at + 1])
        rest = rest[:at] + rest[at + 2:]
    ray.init(address=address, namespace="pdserve", log_to_driver=False, configure_logging=False)
    nodes = [{"node_id": n["NodeID"], "alive": n["Alive"], "resources": n["Resources"]} for n in ray.nodes()]
    workers: dict[str, object] = {}
    for worker_id in rest:
        actor = worker_actor(worker_id)
        records: list[Any] = ray.get(actor.transfer_records.remote())
        workers[worker_id] = {
            "module_file": ray.get(actor.__ray_call__.remote(_module_file)),
            "records": [{"role": r.role, "backend": str(r.backend.value), "source": r.source_worker_id,
                         "outcome": r.outcome, "num_bytes": r.num_bytes} for r in records],
        }
    for worker_id, seconds in slow.items():
        from tests.helpers import actor_faults

        ray.get(worker_actor(worker_id).__ray_call__.remote(actor_faults.slow_steps, seconds))
    for worker_id in heal:
        from tests.helpers import actor_faults

        ray.get(worker_actor(worker_id).__ray_call__.remote(actor_faults.heal))
    # Where each fleet actor lives and how often Ray restarted it (a worker node's loss must not touch it).
    fleets = [{"name": a["Name"], "state": a["State"], "node_id": a["Address"]["NodeID"],
               "num_restarts": a["NumRestarts"], "pid": a["Pid"]}
              for a in ray._private.state.actors().values() if a["ActorClassName"].endswith("FleetActor")]
    print(json.dumps({"nodes": nodes, "workers": workers, "fleets": fleets}))


if __name__ == "__main__":
    main(sys.argv[1:])
