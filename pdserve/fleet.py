"""`pdserve fleet list | stop NAME`: the named fleets (`pdserve serve --fleet-name NAME`) on a Ray cluster.

A named fleet outlives the supervisor that started it (so that a restarted gateway costs no weight load);
`stop` is how one is ended on purpose: its workers stopped, its actor killed, its GPUs freed.
"""

from __future__ import annotations

import argparse
from typing import Any

FLEET_PREFIX = "pdserve-fleet-"


def add_fleet_parser(commands: Any) -> None:
    fleet = commands.add_parser("fleet", help="list or stop the named fleets on a Ray cluster")
    actions = fleet.add_subparsers(dest="action", required=True)
    for action, help_text in (("list", "the named fleets and their settings' layout"),
                              ("stop", "stop a named fleet: its workers, then its actor")):
        parser = actions.add_parser(action, help=help_text)
        if action == "stop":
            parser.add_argument("name", help="the fleet's --fleet-name")
        parser.add_argument("--address", default="auto",
                            help="the Ray cluster (default: auto, the one this node belongs to)")
        parser.set_defaults(handler=run_fleet)


def run_fleet(args: argparse.Namespace) -> int:
    import ray

    from gateway.control.fleet_client import FleetClient
    from gateway.fleet_supervisor import stop_fleet
    from gateway.lifespans import RAY_NAMESPACE

    try:
        ray.init(address=args.address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 configure_logging=False, log_to_driver=False)
    except ConnectionError as error:
        raise ValueError(f"--address {args.address}: no Ray cluster there ({error})") from None
    try:
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["namespace"] == RAY_NAMESPACE and a["name"].startswith(FLEET_PREFIX))
        if args.action == "list":
            for name in names:
                config = FleetClient(ray.get_actor(name)).probe_started(timeout_s=30)
                layout = (f"{config.num_prefill} prefill + {config.num_decode} decode + {config.num_mixed} "
                          f"mixed at start, {config.engine.model_dir}" if config else "not started")
                print(f"{name.removeprefix(FLEET_PREFIX)}\t{layout}")
            return 0
        name = FLEET_PREFIX + args.name
        if name not in names:
            known = ", ".join(n.removeprefix(FLEET_PREFIX) for n in names) or "none"
            raise ValueError(f"no fleet named {args.name!r} (named fleets: {known})")
        stop_fleet(FleetClient(ray.get_actor(name)), name)
        print(f"pdserve: fleet {args.name} stopped")
        return 0
    finally:
        ray.shutdown()
