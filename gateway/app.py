"""The FastAPI application: `create_app(config, frontend)`; all state lives in app.state, set up by its
lifespan (gateway/lifespans.py: a frontend over the fleet actor).

Routes: POST /v1/completions, POST /v1/chat/completions (gateway/api/generate_routes.py); POST /v1/responses
(gateway/api/responses_api/routes.py, served by the chat path); GET /health,
GET /metrics (gateway/api/status_routes.py); GET /v1/models, POST /tokenize, POST /detokenize, GET /version
(gateway/api/utility_routes.py); GET and PUT /admin/pools, GET /admin/workers/{id}/steps
(gateway/api/admin.py). Errors use OpenAI's shape; a client that disconnects aborts its request on both
workers.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response

from gateway.api.admin import router as admin_routes
from gateway.api.body_guard import BodyGuard
from gateway.api.disconnect import ClientGone
from gateway.api.errors import install_error_handlers, without_validation_422
from gateway.api.generate_routes import router as generate_routes
from gateway.api.http_counts import HttpCounts
from gateway.api.http_metrics import instrument_http
from gateway.api.request_id import RequestIdMiddleware, install_log_prefix
from gateway.api.responses_api.routes import router as responses_api_routes
from gateway.api.status_routes import status_routes
from gateway.api.utility_routes import router as utility_routes
from gateway.config import ServeConfig
from gateway.lifespans import FrontendSpec, join_fleet
from gateway.serve_settings import add_cors


def create_app(config: ServeConfig, frontend: FrontendSpec, on_ready: Callable[[], None] | None = None
               ) -> FastAPI:
    """A frontend of the gateway over the fleet actor that `frontend` names; `on_ready` is called once it is
    about to serve (gateway/lifespans.py)."""
    lifespan = join_fleet(config, frontend, on_ready)
    has_docs = not config.disable_fastapi_docs
    app = FastAPI(title="pdserve", lifespan=lifespan, openapi_url="/openapi.json" if has_docs else None,
                  docs_url="/docs" if has_docs else None, redoc_url="/redoc" if has_docs else None)
    app.state.config = config
    app.root_path = config.root_path  # --root-path, as vLLM sets it (gateway/serve_settings.py says why here)

    install_error_handlers(app)
    app.add_middleware(BodyGuard)
    app.add_middleware(RequestIdMiddleware)  # outside BodyGuard: its 413 and 415 carry the id too
    add_cors(app, config)  # outside those: a browser can read their refusals (--allowed-origins)
    app.add_middleware(HttpCounts)  # counts every response, the ones refused above included
    # Outermost: vLLM's HTTP series (prometheus-fastapi-instrumentator), rendered on /metrics with ours.
    app.state.http_registry = instrument_http(app)
    install_log_prefix()
    app.openapi = without_validation_422(app)  # type: ignore[method-assign]

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it: the connection is closed

    app.include_router(generate_routes)
    app.include_router(responses_api_routes)
    app.include_router(status_routes(config.metrics_require_key))
    app.include_router(admin_routes)
    app.include_router(utility_routes)
    return app
