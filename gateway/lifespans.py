"""The frontend's lifespan, and the request path it builds (app.state holds what they make).

Every `pdserve serve` runs the fleet in the fleet actor (gateway/frontends.py starts it) and N ≥ 1 HTTP
frontends over it: one in the supervisor's own process, or N processes of uvicorn's supervisor. Each joins
the fleet with join_fleet() and builds its request path with serve_requests(): tokenizer, request
preparation, admission (its leased share of the decode KV), the service.
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
from gateway.control.messages import FleetInfo, frontend_id
from gateway.control.remote_fleet import RemoteFleet
from gateway.requests.admission import Admission
from gateway.requests.service import GatewayService
from gateway.serve_settings import deadline_policy
from gateway.startup import announce
from gateway.stop_signals import end_requests_before_the_grace, join_ray, unless_stopped
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer
from llm_engine.model_files import load_tokenizer, served_name

# A fixed namespace, so that operators' tools find the workers: ray.get_actor("pdserve-worker-…",
# namespace="pdserve") (worker ids are unique per gateway, so gateways may share it).
RAY_NAMESPACE = "pdserve"

Lifespan = Callable[[FastAPI], AbstractAsyncContextManager[None]]


@dataclass(frozen=True)
class FrontendSpec:
    """How a frontend finds the fleet (gateway/frontends.py writes it; `--api-server-count N` frontends)."""

    fleet_actor: str  # the FleetActor's name in RAY_NAMESPACE
    ray_address: str  # the supervisor's Ray (GCS address)
    num_frontends: int
    # The tokenizer's class as AutoTokenizer picked it in the supervisor (llm_engine/model_files.py
    # load_tokenizer): a frontend loads it by name, without the torch that AutoTokenizer's choice imports.
    tokenizer_class: str | None = None


def serve_requests(app: FastAPI, config: ServeConfig, fleet: RemoteFleet, info: FleetInfo,
                   share: int, tokenizer_class: str | None = None) -> GatewayService:
    """The request path over `fleet`: tokenizer, request preparation, admission (`share`: the decode KV
    tokens the fleet leased this frontend first), the service (app.state)."""
    kv_tokens_per_worker = info.kv_tokens_per_decode_worker
    tokenizer = load_tokenizer(info.model_dir, tokenizer_class)
    if config.chat_template is not None:  # before the Preparer: its tool format is read off the template
        tokenizer.chat_template = load_chat_template(config.chat_template)
    model_name = config.served_model_name or served_name(config.model, info.model_dir)
    spec = config.model_spec(info.model_dir)  # max_model_len: --max-model-len's, else the model's
    if spec.max_model_len > kv_tokens_per_worker:
        print(f"pdserve: warning: the maximum context length ({spec.max_model_len} tokens) exceeds what a "
              f"decode worker's KV cache holds for one request ({kv_tokens_per_worker} tokens): longer "
              "requests get HTTP 400; raise --kv-cache-memory or lower --max-model-len", flush=True)
    app.state.preparer = Preparer(tokenizer, spec, model_name, kv_tokens_per_worker,
                                  config.default_max_tokens, info.block_size, config.tool_call_parser,
                                  reasoning_parser(config.reasoning_parser),
                                  read_sampling_defaults(config.generation_config, info.model_dir),
                                  priority_scheduling=config.scheduling_policy == "priority",
                                  max_logprobs=config.max_logprobs)
    app.state.token_texts = TokenTexts(tokenizer)  # logprobs show each token's own text
    # /v1/models' root: the model as given, as vLLM reports it (a remote `vllm bench serve` loads its
    # tokenizer from it; this server's snapshot path means nothing there); the default model by its directory.
    app.state.model_root = info.model_dir if config.model is None else config.model
    service = GatewayService(
        tokenizer=tokenizer, model_name=model_name, fleet=fleet,
        admission=Admission(share, config.max_waiting, config.queue_timeout_s, config.max_waiting_tokens),
        max_request_tokens=kv_tokens_per_worker,
        deadline_policy=deadline_policy(config), local_prefill=fleet.local_prefill,
        metrics=Metrics(model_name, spec.max_model_len, app.state.http_registry),
        tracer=RequestTracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None,
        shows_prompt_cache=config.enable_prompt_tokens_details,
    )
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


def join_fleet(config: ServeConfig, frontend: FrontendSpec, on_ready: Callable[[], None] | None = None
               ) -> Lifespan:
    """A frontend: join the supervisor's Ray (a frontend process of its own; the one frontend of N = 1 runs in
    the supervisor, already in it) → the fleet actor → a mirror of its workers and this frontend's first
    admission share (gateway/control/remote_fleet.py) → the request path → on_ready (the supervisor's start
    answerer gives up the port) → serve → leave (the fleet and its workers stay)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        joins_ray = not ray.is_initialized()
        if joins_ray:
            join_ray(address=frontend.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                     configure_logging=False, log_to_driver=False)
        client = FleetClient(ray.get_actor(frontend.fleet_actor))
        fleet = RemoteFleet(client, frontend_id(socket.gethostname(), os.getpid()))
        try:
            info, share = await unless_stopped(fleet.join())
            service = serve_requests(app, config, fleet, info, share, frontend.tokenizer_class)
            fleet.start(service.router, service.admission)
            app.state.control = client  # the admin routes ask the fleet actor
            if on_ready is not None:
                on_ready()
            num = frontend.num_frontends
            announce(app, config, info.backend, f" (frontend pid {os.getpid()} of {num})" if num > 1 else "")
            yield
        finally:
            await stop_tracing(app)
            await fleet.stop()
            if joins_ray:
                ray.shutdown()

    return lifespan
