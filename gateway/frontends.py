"""`pdserve serve`: one fleet actor, N ≥ 1 HTTP frontends on one port (N: --api-server-count, default 1).

    supervisor (this process, a Ray driver): fleet_started() (gateway/fleet_supervisor.py):
      Ray (join or start) → the FleetActor, named in RAY_NAMESPACE, started: every worker up and wired,
      the control plane running (gateway/control/fleet_actor.py), while the port answers "starting"
      (gateway/start_answerer.py)
      → N = 1: the one frontend in this process (a plain uvicorn server; the start answerer gives up the
        port once the frontend has joined the fleet)
      → N > 1: the listening socket bound once → prometheus_client's multiprocess directory (a fresh one)
        → uvicorn's Multiprocess supervisor: N frontend processes accept on that socket (the kernel spreads
        connections across them); one that dies is started again (its own connections are lost: the
        fleet ends its streams on the workers once it stops reporting; the other frontends' carry on)
      → a watch thread: should the fleet actor die (a crash, Ray's memory monitor), Ray restarts it empty
        (max_restarts; its workers, detached, live on) and the watch starts its fleet again, which adopts
        those workers as they are (gateway/fleet/adoption.py: no weights load); meanwhile the frontends'
        /health says "unavailable", and they follow the new epoch once it answers. A fleet actor dead for
        good (ray.kill) stops this supervisor with an error, so that whatever supervises it
        (deploy/supervise.py, the kubelet) starts a new one
      → on SIGINT / SIGTERM: the frontends stop, then the fleet (every worker), then Ray if ours.
    A named fleet (--fleet-name, on a cluster: --address) is a detached actor instead: it outlives this
    process, which leaves it running when it ends. The next supervisor with the same settings rejoins it
    (its workers as they were: layout, cached prefixes, running streams' KV), so a gateway restarted by
    deploy/supervise.py or the kubelet costs no weight load; one with other settings replaces it.
    frontend (gateway/app.py create_app(config, FrontendSpec); in each child, built by frontend_app()):
      joins the supervisor's Ray, finds the fleet actor, mirrors its workers, serves.
Why uvicorn's own supervisor for N > 1: it is what `uvicorn --workers N` runs (fork-free spawn, health pings,
restart of dead children), so the frontends are plain uvicorn servers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
from pathlib import Path
from typing import Any

from gateway.config import ServeConfig
from gateway.control.fleet_client import FleetClient
from gateway.fleet_supervisor import StartedFleet, fleet_started, watch_fleet
from gateway.lifespans import FrontendSpec
from gateway.serve_settings import (
    base_url,
    uvicorn_options,
)

# The child reads its settings from the file named here (uvicorn builds each frontend from an import string):
# a file only this user can read, not the environment, which would show the API keys to anyone who can
# read the processes' environments.
FRONTEND_ENV = "PDSERVE_FRONTEND_SPEC"
# uvicorn's supervisor kills a frontend that leaves its ping unanswered this long (uvicorn's default is 5 s).
# A frontend whose loop or CPU share is taken by a burst (fifty fresh schemas, four 900k-character
# /tokenize calls on a loaded 2-core machine) was killed at 5 s in the chaos run of 2026-12-03, cutting
# every stream it held; alive-but-slow is the fleet's lease to judge (FRONTEND_SILENT_S, 10 s), which ends
# only that frontend's channels and lets it resume. Above it, so a frontend's process is killed only once
# the fleet has already given it up. It also bounds a restarted frontend's start-up (joining Ray, mirroring
# the fleet), which takes more than 5 s on a busy machine.
FRONTEND_UNANSWERED_S = 30.0
FRONTEND_EXIT_POLL_S = 0.5  # how often the supervisor looks for frontend processes that exited

logger = logging.getLogger(__name__)


def frontend_app() -> object:
    """uvicorn's app factory in each frontend process."""
    from gateway.app import create_app

    forget_dead_frontends(os.environ["PROMETHEUS_MULTIPROC_DIR"])

    spec = json.loads(Path(os.environ[FRONTEND_ENV]).read_text())
    config = ServeConfig.model_validate(spec.pop("config"))
    return create_app(config, FrontendSpec(**spec))


def forget_dead_frontends(directory: str) -> None:
    """A restarted frontend's predecessor left 'live' gauge files behind: they must not count any more."""
    from prometheus_client import multiprocess

    for name in os.listdir(directory):
        if not name.startswith("gauge_live"):
            continue
        pid = int(name.rsplit("_", 1)[1].removesuffix(".db"))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            multiprocess.mark_process_dead(pid, directory)


def serve_frontends(config: ServeConfig) -> None:
    """Run the fleet and config.api_server_count frontends until a signal stops them."""
    stopping = threading.Event()
    lost: list[str] = []  # why the fleet is gone for good (the watch says)
    if config.api_server_count == 1:  # this process is the frontend: its slowest import meanwhile
        threading.Thread(target=warm_frontend, args=(config,), name="warm-frontend", daemon=True).start()
    with fleet_started(config) as fleet:
        try:
            if config.api_server_count == 1:
                serve_one(config, fleet, stopping, lost)
            else:
                serve_several(config, fleet, stopping, lost)
        finally:
            stopping.set()
    if lost:
        raise SystemExit(f"pdserve: {lost[0]}: stopping, so that this gateway is started again")


def warm_frontend(config: ServeConfig) -> None:
    """Load the tokenizer once while the fleet starts: the first load in a process imports transformers'
    tokenizer code (~1.5 s on 2 cores), which the frontend's start-up would otherwise wait for after the
    fleet is up. A failure is left for the frontend's own load to report."""
    from gateway.startup import resolve_model_dir
    from llm_engine.model_files import load_tokenizer

    with contextlib.suppress(Exception):
        load_tokenizer(resolve_model_dir(config))


def serve_one(config: ServeConfig, fleet: StartedFleet, stopping: threading.Event, lost: list[str]) -> None:
    """The one frontend in this process, on uvicorn without its multiprocess supervisor."""
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from gateway.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(config, fleet.spec, on_ready=fleet.ready),
                                           host=config.host, port=config.port, loop="uvloop",
                                           **uvicorn_options(config)))

    def on_lost(why: str) -> None:
        lost.append(why)
        server.should_exit = True

    threading.Thread(target=watch_fleet, args=(fleet.client, fleet.start, on_lost, stopping),
                     name="fleet-watch", daemon=True).start()
    server.run()
    if not server.started:  # its lifespan failed (it said why), as uvicorn.run() exits then
        raise SystemExit(STARTUP_FAILURE)


def serve_several(config: ServeConfig, fleet: StartedFleet, stopping: threading.Event, lost: list[str]
                  ) -> None:
    """config.api_server_count frontend processes under uvicorn's supervisor, on one socket."""
    import uvicorn
    from uvicorn.supervisors import Multiprocess

    metrics_dir = tempfile.mkdtemp(prefix="pdserve-metrics-")
    try:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        spec_path = Path(metrics_dir) / "frontend.json"  # in a directory of mode 0700, removed at the end
        spec_path.touch(mode=0o600)
        spec_path.write_text(json.dumps({"config": fleet.resolved.model_dump(mode="json"),
                                         **dataclasses.asdict(fleet.spec)}))
        os.environ[FRONTEND_ENV] = str(spec_path)
        # TLS too: each frontend loads the key and certificate into its own SSL context.
        server = uvicorn.Config("gateway.frontends:frontend_app", factory=True, host=config.host,
                                port=config.port, loop="uvloop", workers=config.api_server_count,
                                timeout_worker_healthcheck=int(FRONTEND_UNANSWERED_S),
                                **uvicorn_options(config))
        print(f"pdserve: fleet {fleet.spec.fleet_actor} is up; starting {config.api_server_count} frontends "
              f"on {base_url(config)}", flush=True)
        fleet.ready()
        frontends = Multiprocess(server, sockets=[server.bind_socket()])

        def on_lost(why: str) -> None:
            lost.append(why)
            frontends.should_exit.set()

        threading.Thread(target=watch_fleet, args=(fleet.client, fleet.start, on_lost, stopping),
                         name="fleet-watch", daemon=True).start()
        threading.Thread(target=watch_exits, args=(frontends, fleet.client, stopping), name="frontend-exits",
                         daemon=True).start()
        frontends.run()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def watch_exits(frontends: Any, fleet: FleetClient, stopping: threading.Event) -> None:
    """Until `stopping`, tell the fleet each frontend process (of uvicorn's Multiprocess `frontends`) that
    exited, within FRONTEND_EXIT_POLL_S: its streams end on the workers at once, not after the fleet's
    FRONTEND_SILENT_S of silence (kept for what only an exit proves: a paused frontend is not gone). uvicorn
    starts a new process in its place; it joins the fleet under a new id."""
    host = socket.gethostname()
    watched: dict[int, Any] = {}  # pid → its process (uvicorn may replace it in the list before we look)
    while not stopping.wait(FRONTEND_EXIT_POLL_S):
        for process in list(frontends.processes):
            if process.pid is not None:
                watched.setdefault(process.pid, process)
        exited = [pid for pid, process in watched.items() if process.process.exitcode is not None]
        if not exited:
            continue
        try:
            fleet.frontends_exited(host, exited)
        except Exception:  # the fleet actor is restarting: its silence rule ends those streams
            logger.exception("could not tell the fleet that frontends %s exited", exited)
        for pid in exited:
            release_health_check(watched.pop(pid))


def release_health_check(process: Any) -> None:
    """uvicorn's supervisor may be waiting (up to FRONTEND_UNANSWERED_S) for the ping answer of a frontend
    that has since exited (stopped by SIGTERM, it went on answering nothing while its streams ended): the
    answer is written into the pipe from this side, so the supervisor's loop moves on, sees the process gone
    and starts a new one within its next round, not 30 s later. The pipe is the dead process's alone and
    is dropped with it."""
    with contextlib.suppress(OSError, AttributeError):
        process.child_conn.send(False)


