"""The server's two lifespans, and the request path they both build (app.state holds what they make).

    own_fleet:  the whole gateway in this process, fleet included (`pdserve serve`).
    join_fleet: one of several HTTP frontends over a fleet actor (`--api-server-count N`).
Both build the request path with serve_requests(): tokenizer, request preparation, admission, the service.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import ray
from fastapi import FastAPI

from gateway.api.chat_template import load_chat_template
from gateway.api.logprob_format import TokenTexts
from gateway.api.prepare import Preparer
from gateway.api.reasoning import reasoning_parser
from gateway.api.sampling_defaults import read_sampling_defaults
from gateway.config import ServeConfig
from gateway.control.fleet_client import FleetClient
from gateway.control.messages import frontend_id
from gateway.control.plane import ControlPlane, decode_kv_tokens
from gateway.control.remote_fleet import RemoteFleet
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.view import FleetView
from gateway.requests.admission import Admission, admission_capacity
from gateway.requests.service import GatewayService
from gateway.serve_settings import (
    controller_policy,
    deadline_policy,
    deployment_config,
    local_prefill_policy,
    planner_settings,
)
from gateway.start_answerer import StartAnswerer
from gateway.startup import announce, announce_kv, resolve_model_dir
from gateway.stop_signals import end_requests_before_the_grace, join_ray, unless_stopped
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer
from llm_engine.model_files import load_tokenizer, served_name
from worker_runtime.roles import Role

# A fixed namespace, so that operators' tools find the workers: ray.get_actor("pdserve-worker-…",
# namespace="pdserve") (worker ids are unique per gateway, so gateways may share it).
RAY_NAMESPACE = "pdserve"

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass(frozen=True)
class FrontendSpec:
    """One of several HTTP frontends (`--api-server-count N`): the fleet lives in a named actor."""

    fleet_actor: str  # the FleetActor's name in RAY_NAMESPACE
    ray_address: str  # the supervisor's Ray (GCS address)
    num_frontends: int


def serve_requests(app: FastAPI, config: ServeConfig, fleet: FleetView, model_dir: str,
                   kv_tokens_per_worker: int, num_frontends: int) -> GatewayService:
    """The request path over `fleet`: tokenizer, request preparation, admission, the service (app.state)."""
    tokenizer = load_tokenizer(model_dir)
    if config.chat_template is not None:  # before the Preparer: its tool format is read off the template
        tokenizer.chat_template = load_chat_template(config.chat_template)
    model_name = config.served_model_name or served_name(config.model, model_dir)
    spec = config.model_spec(model_dir)  # max_model_len: --max-model-len's, else the model's
    if spec.max_model_len > kv_tokens_per_worker:
        print(f"pdserve: warning: the maximum context length ({spec.max_model_len} tokens) exceeds what a "
              f"decode worker's KV cache holds for one request ({kv_tokens_per_worker} tokens): longer "
              "requests get HTTP 400; raise --kv-cache-memory or lower --max-model-len", flush=True)
    app.state.preparer = Preparer(tokenizer, spec, model_name, kv_tokens_per_worker,
                                  config.default_max_tokens, fleet.block_size, config.tool_call_parser,
                                  reasoning_parser(config.reasoning_parser),
                                  read_sampling_defaults(config.generation_config, model_dir))
    app.state.token_texts = TokenTexts(tokenizer)  # logprobs show each token's own text
    # /v1/models' root: the model as given, as vLLM reports it (a remote `vllm bench serve` loads its
    # tokenizer from it; this server's snapshot path means nothing there); the default model by its directory.
    app.state.model_root = model_dir if config.model is None else config.model
    num_decoding = len(fleet.active(Role.DECODE, Role.MIXED))
    capacity = admission_capacity(kv_tokens_per_worker, num_decoding, num_frontends)
    service = GatewayService(
        tokenizer=tokenizer, model_name=model_name, fleet=fleet,
        admission=Admission(capacity, config.max_waiting, config.queue_timeout_s, config.max_waiting_tokens),
        max_request_tokens=kv_tokens_per_worker,
        deadline_policy=deadline_policy(config), local_prefill=local_prefill_policy(config),
        num_frontends=num_frontends,
        metrics=Metrics(model_name, spec.max_model_len, app.state.http_registry),
        tracer=RequestTracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None,
    )
    fleet.on_change.append(service.on_pool_change)
    app.state.service = service

    def end_open_requests() -> None:
        num_ended = service.end_open_requests()
        print(f"pdserve: stopping: {num_ended} requests still open ended with a clear error", flush=True)

    end_requests_before_the_grace(config.shutdown_grace_s, end_open_requests)
    return service


async def stop_tracing(app: FastAPI) -> None:
    """Send the traces still queued (off the event loop: a collector that does not answer takes the
    exporter's timeout) and stop the exporter."""
    service: GatewayService | None = getattr(app.state, "service", None)
    if service is not None and service.tracer is not None:
        await asyncio.to_thread(service.tracer.shutdown)


def own_fleet(config: ServeConfig) -> Lifespan:
    """The whole gateway in this process: Ray (join or start) → model dir → both pools started and
    connected → the request path; admission capacity from the decode workers' KV → the control plane (pool
    watch: failed workers are replaced, capacity follows the live decode workers; the ratio controller) →
    serve → shutdown of every actor (and of Ray if ours)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started_ray = not ray.is_initialized()
        if started_ray:
            join_ray(address=config.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                     configure_logging=False)
        deployment = PDDeployment(deployment_config(config, resolve_model_dir(config)))
        # GET /health says how far start-up has come until uvicorn binds the port (gateway/start_answerer.py).
        answerer = StartAnswerer(config, deployment.bring_up_log.progress)
        try:
            await unless_stopped(deployment.start())
        except BaseException:
            answerer.close()
            raise
        plane: ControlPlane | None = None
        try:
            service = serve_requests(app, config, deployment, deployment.config.engine.model_dir,
                                     min(await decode_kv_tokens(deployment)), num_frontends=1)
            policy = controller_policy(config)
            plane = ControlPlane(deployment, service.router, service.recent, policy, service.traffic,
                                 planner_settings(config))
            service.on_prompt.append(plane.controller.note_prompt)
            plane.start(auto=config.is_auto)
            app.state.control = plane
            answerer.close()
            announce(app, config, deployment.backend.value)
            announce_kv(list(deployment.workers.values()))
            yield
        finally:
            answerer.close()
            await stop_tracing(app)
            await (plane.stop() if plane is not None else deployment.shutdown())
            if started_ray:
                ray.shutdown()

    return lifespan


def join_fleet(config: ServeConfig, frontend: FrontendSpec) -> Lifespan:
    """One of several frontends (gateway/frontends.py starts them): join the supervisor's Ray → the fleet
    actor → a mirror of its workers (gateway/control/remote_fleet.py) → the request path; this frontend's
    share of the admission capacity → serve → leave (the fleet and workers stay)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        join_ray(address=frontend.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 configure_logging=False, log_to_driver=False)
        client = FleetClient(ray.get_actor(frontend.fleet_actor))
        fleet = RemoteFleet(client, frontend_id(socket.gethostname(), os.getpid()))
        try:
            info = await unless_stopped(fleet.start())
            service = serve_requests(app, config, fleet, info.model_dir, info.kv_tokens_per_decode_worker,
                                     frontend.num_frontends)
            fleet.router, fleet.admission = service.router, service.admission
            fleet.on_share.append(service.set_share)
            service.router.local_prefill = fleet.local_prefill
            service.on_prompt.append(fleet.note_prompt)
            service.router.on_local_prefill.append(fleet.note_prompt)
            service.on_finished.append(fleet.note_finished)
            service.traffic.on_note.append(fleet.note_traffic)
            app.state.control = client  # the admin routes ask the fleet actor
            announce(app, config, info.backend, f" (frontend pid {os.getpid()} of {frontend.num_frontends})")
            yield
        finally:
            await stop_tracing(app)
            await fleet.stop()
            ray.shutdown()

    return lifespan
