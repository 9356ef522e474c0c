"""The routes a scraper or a load balancer reads: GET /health (no key) and GET /metrics (no key unless
--metrics-require-key).

    /health   the pools' state from the pool watch's latest round (no RPC per call): ok, degraded (200) or
              unavailable (503), with active and target workers per role.
    /metrics  Prometheus text: the request path's series and the fleet's (gateway/telemetry/metric_names.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from gateway.api.auth import require_api_key
from gateway.api.errors import documented
from gateway.requests.service import GatewayService
from gateway.telemetry.fleet_metrics import FleetStatus


def status_routes(metrics_require_key: bool) -> APIRouter:
    """/health and /metrics; the latter behind the API key when asked."""
    router = APIRouter()

    @router.get("/health", responses={503: {"description": "unavailable: no live worker can decode, or the "
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
    metrics_guard = [Depends(require_api_key)] if metrics_require_key else []

    @router.get("/metrics", dependencies=metrics_guard, responses=documented(401) if metrics_guard else {},
                response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        service: GatewayService = request.app.state.service
        fleet: FleetStatus = await request.app.state.control.status()
        return Response(service.metrics.render(fleet), media_type="text/plain; version=0.0.4")

    return router
