"""The FastAPI application: `create_app(config)`; all state lives in app.state (set up in `lifespan`).

    lifespan, the whole gateway in this process: Ray (join or start) → model dir → both pools started and
              connected → tokenizer; admission capacity from the decode workers' KV → the control plane
              (pool watch: failed workers are replaced, capacity follows the live decode workers; the ratio
              controller) → serve → shutdown of every actor (and of Ray if ours).
    lifespan, one of several frontends (gateway/frontends.py starts them): join the supervisor's Ray → the
              fleet actor → a mirror of its workers (gateway/control/remote_fleet.py) → tokenizer; this
              frontend's share of the admission capacity → serve → leave (the fleet and workers stay).
Routes: POST /v1/completions, POST /v1/chat/completions, GET /health, GET /metrics; GET /v1/models, POST
/tokenize, POST /detokenize, GET /version (gateway/api/utility_routes.py); GET and PUT /admin/pools
(gateway/api/admin.py). Errors use OpenAI's shape; a client that disconnects aborts
its request on both workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import ray
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.background import BackgroundTask

from gateway.api.admin import router as admin_routes
from gateway.api.auth import require_api_key
from gateway.api.body_guard import BodyGuard
from gateway.api.delivery import BoundedStreamingResponse
from gateway.api.disconnect import ClientGone, all_or_none, unless_client_leaves
from gateway.api.errors import documented, install_error_handlers, without_validation_422
from gateway.api.http_counts import HttpCounts
from gateway.api.logprob_format import TokenTexts
from gateway.api.prepare import Preparer
from gateway.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from gateway.api.request_id import RequestIdMiddleware, install_log_prefix, request_id_of
from gateway.api.responses import chat_response, chat_stream, completion_response, completion_stream
from gateway.api.utility_routes import router as utility_routes
from gateway.config import ServeConfig
from gateway.control.fleet_client import FleetClient
from gateway.control.plane import ControlPlane, build_planner, decode_kv_tokens
from gateway.control.remote_fleet import RemoteFleet
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.view import FleetView
from gateway.requests.admission import Admission, admission_capacity
from gateway.requests.service import GatewayService, PreparedRequest
from gateway.startup import announce, announce_kv, resolve_model_dir
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tracing import RequestTracer, trace_headers
from llm_engine.model_files import served_name
from llm_engine.model_loader import load_tokenizer
from pool_worker import Role

logger = logging.getLogger(__name__)
RAY_NAMESPACE = "pdserve"


# What each kind of route documents beyond its 200 (errors.documented gives OpenAI's error body).
_GENERATE = documented(400, 401, 404, 413, 415, 429, 503)
# With "stream": true: events whose data is a JSON chunk of the 200 model, the last one "[DONE]".
_SSE = {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                         "properties": {"data": {"type": "string"}}}}}


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
    model_name = config.served_model_name or served_name(config.model, model_dir)
    spec = config.model_spec(model_dir)  # max_model_len: --max-model-len's, else the model's
    if spec.max_model_len > kv_tokens_per_worker:
        print(f"pdserve: warning: the maximum context length ({spec.max_model_len} tokens) exceeds what a "
              f"decode worker's KV cache holds for one request ({kv_tokens_per_worker} tokens): longer "
              "requests get HTTP 400; raise --kv-cache-memory or lower --max-model-len", flush=True)
    app.state.preparer = Preparer(tokenizer, spec, model_name, kv_tokens_per_worker,
                                  config.default_max_tokens, fleet.block_size, config.tool_call_parser)
    app.state.token_texts = TokenTexts(tokenizer)  # logprobs show each token's own text
    app.state.model_dir = model_dir  # /v1/models' root
    num_decoding = len(fleet.active(Role.DECODE, Role.MIXED))
    capacity = admission_capacity(kv_tokens_per_worker, num_decoding, num_frontends)
    service = GatewayService(
        tokenizer=tokenizer, model_name=model_name, fleet=fleet,
        admission=Admission(capacity, config.max_waiting, config.queue_timeout_s, config.max_waiting_tokens),
        max_request_tokens=kv_tokens_per_worker,
        deadline_policy=config.deadline_policy(), local_prefill=config.local_prefill_policy(),
        num_frontends=num_frontends, metrics=Metrics(model_name, spec.max_model_len),
        tracer=RequestTracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None,
    )
    fleet.on_change.append(service.on_pool_change)
    app.state.service = service
    return service


async def stop_tracing(app: FastAPI) -> None:
    """Send the traces still queued (off the event loop: a collector that does not answer takes the
    exporter's timeout) and stop the exporter."""
    service: GatewayService | None = getattr(app.state, "service", None)
    if service is not None and service.tracer is not None:
        await asyncio.to_thread(service.tracer.shutdown)


def traced(service: GatewayService, prepared: PreparedRequest, request: Request) -> PreparedRequest:
    """The request with its HTTP request's W3C trace context, when traces are sent."""
    if service.tracer is None:
        return prepared
    return dataclasses.replace(prepared, trace_headers=trace_headers(request.headers))


def create_app(config: ServeConfig, frontend: FrontendSpec | None = None) -> FastAPI:
    """The gateway: with `frontend`, one of several HTTP processes over a fleet actor; else the whole gateway
    in this process (fleet included)."""

    @asynccontextmanager
    async def own_fleet(app: FastAPI) -> AsyncIterator[None]:
        started_ray = not ray.is_initialized()
        if started_ray:
            # A fixed namespace, so that operators' tools find the workers: ray.get_actor("pdserve-worker-…",
            # namespace="pdserve") (worker ids are unique per gateway, so gateways may share it).
            ray.init(address=config.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                     configure_logging=False)
        deployment = PDDeployment(config.deployment_config(resolve_model_dir(config)))
        await deployment.start()
        plane: ControlPlane | None = None
        try:
            service = serve_requests(app, config, deployment, deployment.config.engine.model_dir,
                                     min(await decode_kv_tokens(deployment)), num_frontends=1)
            policy = config.controller_policy()
            planning = config.planner_settings()
            planner = build_planner(planning, deployment, policy) if planning is not None else None
            plane = ControlPlane(deployment, service.router, service.recent, policy, service.traffic, planner)
            service.on_prompt.append(plane.controller.note_prompt)
            plane.start(auto=config.ratio == "auto")
            app.state.control = plane
            announce(app, config, deployment.backend.value)
            announce_kv(list(deployment.workers.values()))
            yield
        finally:
            await stop_tracing(app)
            await (plane.stop() if plane is not None else deployment.shutdown())
            if started_ray:
                ray.shutdown()

    @asynccontextmanager
    async def join_fleet(app: FastAPI) -> AsyncIterator[None]:
        assert frontend is not None
        ray.init(address=frontend.ray_address, namespace=RAY_NAMESPACE, include_dashboard=False,
                 configure_logging=False, log_to_driver=False)
        client = FleetClient(ray.get_actor(frontend.fleet_actor))
        fleet = RemoteFleet(client, f"frontend-{uuid.uuid4().hex[:12]}")
        try:
            info = await fleet.start()
            service = serve_requests(app, config, fleet, info.model_dir, info.kv_tokens_per_decode_worker,
                                     frontend.num_frontends)
            fleet.router, fleet.admission = service.router, service.admission
            fleet.on_share.append(service.set_share)
            service.router.local_prefill = fleet.local_prefill
            service.on_prompt.append(fleet.note_prompt)
            service.router.on_local_prefill.append(fleet.note_prompt)
            service.on_finished.append(fleet.note_finished)
            app.state.control = client  # the admin routes ask the fleet actor
            announce(app, config, info.backend, f" (frontend pid {os.getpid()} of {frontend.num_frontends})")
            yield
        finally:
            await stop_tracing(app)
            await fleet.stop()
            ray.shutdown()

    lifespan = own_fleet if frontend is None else join_fleet
    app = FastAPI(title="pdserve", lifespan=lifespan)
    app.state.config = config

    install_error_handlers(app)
    app.add_middleware(BodyGuard)
    app.add_middleware(RequestIdMiddleware)  # outside BodyGuard: its 413 and 415 carry the id too
    app.add_middleware(HttpCounts)  # outermost: counts every response, the ones refused above included
    install_log_prefix()
    app.openapi = without_validation_422(app)  # type: ignore[method-assign]

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed

    async def respond(service: GatewayService, body: CompletionRequest | ChatCompletionRequest,
                      prepared: PreparedRequest, request: Request) -> Response:
        """Admit, then answer whole or as an SSE stream, in the framing of the request's endpoint.

        Until the response starts, a client that leaves is noticed (it leaves the admission line, a whole
        response's generation is aborted); once an SSE stream runs, Starlette notices it and closes the
        stream, which aborts the request on both workers.
        """
        # Watching for the client's disconnect costs two tasks: only worth it when the request must wait.
        reservation = service.try_admit(prepared)
        if reservation is None:
            reservation = await unless_client_leaves(request, service.admit(prepared))
        deltas = service.stream(prepared, reservation)
        texts: TokenTexts = request.app.state.token_texts
        is_chat = isinstance(body, ChatCompletionRequest)
        # Chat with tools: the answer is read for tool calls in the model's format.
        tools = {"tool_parser": request.app.state.preparer.tool_parser} if prepared.parses_tool_calls else {}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            framing = chat_stream if is_chat else completion_stream
            stream = framing(service, texts, body, prepared, deltas, include_usage, **tools)  # type: ignore[arg-type]
            return BoundedStreamingResponse(
                stream, service.send_by(prepared, reservation), service.metrics.stalled_streams.inc,
                media_type="text/event-stream", background=BackgroundTask(reservation.release_at_stream_end))
        whole = chat_response if is_chat else completion_response
        try:
            answer = whole(service, texts, body, prepared, deltas, **tools)  # type: ignore[arg-type]
            response = await unless_client_leaves(request, answer)
        finally:
            await deltas.aclose()  # aborts both workers unless the request finished
        return JSONResponse(response.model_dump(exclude_none=True))

    async def respond_batch(service: GatewayService, body: CompletionRequest, batch: list[PreparedRequest],
                            request: Request) -> Response:
        """A batch of prompts (not streamed): each runs as a request of its own, concurrently; one response
        with a choice per prompt (`index` in prompt order) and the usage summed."""
        texts: TokenTexts = request.app.state.token_texts

        async def one(prepared: PreparedRequest) -> CompletionResponse:
            reservation = service.try_admit(prepared) or await service.admit(prepared)
            deltas = service.stream(prepared, reservation)
            try:
                return await completion_response(service, texts, body, prepared, deltas)
            finally:
                await deltas.aclose()  # aborts both workers unless the request finished

        answers = await unless_client_leaves(request, all_or_none([one(p) for p in batch]))
        usages = [a.usage for a in answers if a.usage is not None]
        usage = Usage(prompt_tokens=sum(u.prompt_tokens for u in usages),
                      completion_tokens=sum(u.completion_tokens for u in usages),
                      total_tokens=sum(u.total_tokens for u in usages))
        whole = CompletionResponse(id=batch[0].request_id, model=service.model_name,
                                   choices=[c for a in answers for c in a.choices], usage=usage)
        return JSONResponse(whole.model_dump(exclude_none=True))

    @app.post("/v1/completions", dependencies=[Depends(require_api_key)],
              responses={200: {"model": CompletionResponse, "content": _SSE}, **_GENERATE})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service: GatewayService = request.app.state.service
        batch = await request.app.state.preparer.prepare_completion(body, request_id_of(request.state))
        batch = [traced(service, prepared, request) for prepared in batch]
        if len(batch) == 1:
            return await respond(service, body, batch[0], request)
        return await respond_batch(service, body, batch, request)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_api_key)],
              responses={200: {"model": ChatCompletionResponse, "content": _SSE}, **_GENERATE})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service: GatewayService = request.app.state.service
        prepared = await request.app.state.preparer.prepare_chat(body, request_id_of(request.state))
        return await respond(service, body, traced(service, prepared, request), request)

    @app.get("/health", responses={503: {"description": "unavailable: no live worker can decode, or the "
                                                        "fleet actor does not answer (see reason)"}})
    async def health(request: Request) -> JSONResponse:
        """ok (200), degraded (200: serving, some workers being replaced or not placed on a node yet),
        unavailable (503)."""
        service: GatewayService = request.app.state.service
        # From the pool watch's latest round (a worker that died is noticed within its interval): this route
        # is unauthenticated, so it must not cost an RPC per worker per call.
        pools = service.fleet.health()
        body = {"status": pools.status,
                "active_workers": pools.active, "target_workers": pools.target,
                "replacing": pools.num_replacing, "pending": pools.num_pending}
        if pools.reason:
            body["reason"] = pools.reason
        return JSONResponse(body, status_code=503 if pools.status == "unavailable" else 200)

    # Open unless asked (scrapers send no key); its OpenAPI entry declares the key only when it wants it.
    metrics_guard = [Depends(require_api_key)] if config.metrics_require_key else []
    @app.get("/metrics", dependencies=metrics_guard, responses=documented(401) if metrics_guard else {},
             response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        service: GatewayService = request.app.state.service
        fleet: FleetStatus = await request.app.state.control.status()
        service.metrics.admission_waiting.set(service.admission.num_waiting)
        service.metrics.admission_reserved.set(service.admission.reserved_tokens)
        return Response(service.metrics.render(fleet), media_type="text/plain; version=0.0.4")

    app.include_router(admin_routes)
    app.include_router(utility_routes)
    return app
