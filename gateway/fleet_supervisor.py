"""The half of `pdserve serve`'s supervisor that owns the fleet actor (the frontends' half:
gateway/frontends.py).

    fleet_started(): Ray (join or start) → the FleetActor, named in RAY_NAMESPACE, started or (a named fleet)
      rejoined, while the port answers "starting" → yields a StartedFleet (how frontends find it) → the fleet
      stopped (not a named one), Ray if ours.
    watch_fleet(): should the fleet actor die, Ray restarts it empty and the watch starts its fleet again,
      which adopts the workers as they are; one dead for good stops the supervisor with an error.
    open_fleet() / stop_fleet(): the actor made or found by name; every worker stopped with it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from gateway.config import ServeConfig
from gateway.control.fleet_client import FleetClient
from gateway.fleet.config import DeploymentConfig
from gateway.fleet.rank_groups import remove_rank_groups_of
from gateway.lifespans import RAY_NAMESPACE, FrontendSpec
from gateway.serve_settings import (
    controller_policy,
    deployment_config,
    local_prefill_policy,
    planner_settings,
)
from gateway.start_answerer import StartAnswerer
from llm_engine.model_files import tokenizer_class_name

FLEET_WATCH_S = 1.0
FLEET_PROBE_TIMEOUT_S = 10.0  # a paused fleet is the frontends' to report (/health), not a death
FLEET_GONE_S = 60.0  # a fleet actor that fails every probe this long is not restarting: dead for good

logger = logging.getLogger(__name__)


@dataclass
class StartedFleet:
    """The fleet actor, started, and how frontends find it."""

    client: FleetClient
    spec: FrontendSpec
    start: Callable[[FleetClient], None]  # starts it again (after Ray restarted it empty)
    ready: Callable[[], None]  # the port is the frontends' now: the start answerer lets it go
    # The settings with the device and dtype as resolved here: a frontend process that read "auto" would ask
    # torch (it has none).
    resolved: ServeConfig


@contextlib.contextmanager
def fleet_started(config: ServeConfig) -> Iterator[StartedFleet]:
    """Ray (join or start) → the fleet actor started, or rejoined (a named one), while the port answers
    "starting" → yields it → the fleet stopped (not a named one: see the module's docstring), Ray if ours."""
    from gateway.startup import resolve_model_dir

    started_ray = not ray.is_initialized()
    if started_ray:
        ray.init(address=config.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 configure_logging=False)
    try:
        deployment = deployment_config(config, resolve_model_dir(config))
        is_named = config.fleet_name is not None
        name = f"pdserve-fleet-{config.fleet_name if is_named else uuid.uuid4().hex[:6]}"
        fleet, is_rejoined = open_fleet(name, deployment, outlives=is_named)

        def start(fleet: FleetClient) -> None:
            fleet.start(deployment, controller_policy(config), local_prefill_policy(config),
                        config.is_auto, planner_settings(config))

        try:
            # GET /health says how far the fleet's start has come until a frontend binds the port.
            answerer = StartAnswerer(config, fleet.start_progress)
            try:
                if is_rejoined:
                    print(f"pdserve: rejoined fleet {name} and its workers", flush=True)
                    for note in fleet.rejoin(controller_policy(config), local_prefill_policy(config),
                                             config.is_auto, planner_settings(config)):
                        print(f"pdserve: fleet {name}: {note}", flush=True)
                else:
                    start(fleet)
                engine = deployment.engine
                spec = FrontendSpec(name, ray.get_runtime_context().gcs_address, config.api_server_count,
                                    tokenizer_class_name(engine.model_dir))
                resolved = config.model_copy(update={"device": engine.device, "dtype": engine.dtype})
                yield StartedFleet(fleet, spec, start, answerer.close, resolved)
            finally:
                answerer.close()
        finally:
            if not is_named:
                stop_fleet(fleet, name)
    finally:
        if started_ray:
            ray.shutdown()


def watch_fleet(fleet: FleetClient, start: Callable[[FleetClient], None], on_lost: Callable[[str], None],
                stopping: threading.Event) -> None:
    """Until `stopping`, probe the fleet actor every FLEET_WATCH_S: one that Ray restarted (it answers, not
    started) is started again (retried until it starts); one Ray is still restarting (ActorUnavailableError)
    is waited for, however long; one that Ray reports dead (another RayActorError) for FLEET_GONE_S is gone
    for good: on_lost. A probe that times out is neither: a paused or busy fleet is left alone (the
    frontends' /health reports it). (A restart that took over 60 s on a loaded node once counted as gone, and
    stopped the gateway: the chaos run of issue 31.)"""
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

    failing_since: float | None = None
    restarting_since: float | None = None
    while not stopping.wait(FLEET_WATCH_S):
        try:
            started = fleet.probe_started(FLEET_PROBE_TIMEOUT_S)
        except GetTimeoutError:
            continue
        except ActorUnavailableError:  # Ray is restarting it, however long that takes (loaded: minutes)
            now = time.monotonic()
            if restarting_since is None or now - restarting_since > FLEET_GONE_S:
                print("pdserve: the fleet actor is being restarted by Ray; waiting for it", flush=True)
                restarting_since = now
            continue
        except RayActorError as error:  # died, and Ray says it will not come back
            failing_since = failing_since or time.monotonic()
            if time.monotonic() - failing_since > FLEET_GONE_S and not stopping.is_set():
                on_lost(f"the fleet actor is gone ({type(error).__name__})")
                return
            continue
        except Exception:
            logger.exception("the fleet probe failed")
            continue
        failing_since = restarting_since = None
        if started is not None:
            continue
        print("pdserve: the fleet actor was restarted: starting the fleet again over the workers that live "
              "on", flush=True)
        began = time.monotonic()
        try:
            start(fleet)
        except Exception:  # Ray itself may be struggling: the next round tries again
            logger.exception("the fleet did not start")
            continue
        print(f"pdserve: the fleet serves again ({time.monotonic() - began:.0f} s to start)", flush=True)


def open_fleet(name: str, deployment: DeploymentConfig, outlives: bool) -> tuple[FleetClient, bool]:
    """The fleet actor `name`, and whether it has started already: a new one; or, when it `outlives` this
    process (detached), the one running under that name if it started with these settings, else a new one
    in its place."""
    from gateway.control.fleet_actor import FleetActor

    # The fleet's loop does control work only (no request passes through it): it needs no CPU of its own.
    # It runs on this process's node, beside the frontends: with no CPU asked, Ray would place it on any
    # node, and a worker node's loss would then take the fleet down with it. The affinity is hard: Ray's
    # soft affinity placed it on other nodes half the time where this node offers no CPU (a head started
    # with --num-cpus 0), and a fleet this process owns dies with it anyway. A named fleet outlives this
    # process: soft, so that Ray can restart it elsewhere should this node go. Ray restarts it should it
    # die (empty: the supervisor's watch starts its fleet again, adopting the workers that live on).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=outlives)
    options: dict[str, Any] = {"name": name, "num_cpus": 0, "max_concurrency": 1000, "max_restarts": -1,
                               "scheduling_strategy": here}
    if not outlives:
        return FleetClient(ray.remote(FleetActor).options(**options).remote()), False
    options.update(lifetime="detached", get_if_exists=True)
    fleet = FleetClient(ray.remote(FleetActor).options(**options).remote())
    started = fleet.probe_started()
    if started is None or started == deployment:
        return fleet, started is not None
    print(f"pdserve: fleet {name} runs other settings: replacing it and its workers", flush=True)
    stop_fleet(fleet, name)
    deadline = time.monotonic() + 60
    while _is_named_actor(name) and time.monotonic() < deadline:  # the name is free once it is gone
        time.sleep(0.5)
    return FleetClient(ray.remote(FleetActor).options(**options).remote()), False


def _is_named_actor(name: str) -> bool:
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def stop_fleet(fleet: FleetClient, name: str) -> None:
    """The fleet actor `name` stops its workers and is killed; the rank groups left under its name (a worker
    that died while no fleet actor watched) are removed."""
    with contextlib.suppress(Exception):  # already gone, or stuck: the kill below ends it
        fleet.shutdown(timeout_s=60)
    fleet.kill()
    for group in remove_rank_groups_of(name):
        print(f"pdserve: removed the placement group {group}, left by a worker that is gone", flush=True)
