"""Counts every HTTP response by route template, method and status (pdserve:http_requests_total): 4xx, 429
and 5xx rates come from it, as they do from prometheus-fastapi-instrumentator's http_requests_total on vLLM.

The route's template (`/v1/completions`), never the raw path: a scan of random paths must not grow the label
set ("none" for a path no route matches). A response that never started (the app raised) counts as a 500,
the status Starlette's outermost error middleware then sends.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.telemetry.metrics import Metrics


class HttpCounts:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        finally:
            service = getattr(scope["app"].state, "service", None)  # none before the lifespan set it up
            if service is not None:
                metrics: Metrics = service.metrics
                route = scope.get("route")
                metrics.observe_http(getattr(route, "path", "none"), scope["method"], status)
