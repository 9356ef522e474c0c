"""X-Request-Id: the client's value (checked, bounded) or one minted here, on every /v1 response and in
the log lines written while the request is served.

The client's value names the request in its response header exactly; the ids the workers see (and the
response body's `id`) add a random suffix to it, because a client may send one id twice at once, and two
requests under one id on a worker would share outputs and aborts. A minted id is unique already and is used
as it is (a batch of prompts adds each prompt's index).
"""

from __future__ import annotations

import logging
import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import error

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# Visible ASCII without quotes or backslash: safe in a header, a log line and a JSON string, and wide enough
# for UUIDs, W3C trace ids and the ids proxies mint.
_VALID = re.compile(rf"[!#-\[\]-~]{{1,{MAX_LENGTH}}}")
# The request being served in this task, for log lines (contextvars follow the tasks it starts).
current_request_id: ContextVar[str] = ContextVar("pdserve_request_id", default="")


@dataclass(frozen=True)
class RequestId:
    header: str  # what X-Request-Id says on the response
    is_minted: bool  # minted here (unique), not the client's

    @classmethod
    def mint(cls) -> RequestId:
        return cls(f"req-{uuid.uuid4().hex}", True)

    def for_prompt(self, index: int, num_prompts: int) -> str:
        """The id prompt `index` of `num_prompts` runs under on the workers (and its response's `id`)."""
        if not self.is_minted:
            return f"{self.header}-{uuid.uuid4().hex[:8]}"
        return self.header if num_prompts == 1 else f"{self.header}-{index}"


def request_id_of(scope_state: Any) -> RequestId:
    """The request's id (request.state), or a fresh one where no middleware set it (unit tests)."""
    found = getattr(scope_state, "request_id", None)
    return found if isinstance(found, RequestId) else RequestId.mint()


class RequestIdMiddleware:
    """Reads X-Request-Id (a bad one is a 400), sets it in request.state and the log context, returns it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER.lower())
        request_id = RequestId.mint() if given is None else RequestId(given, False)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id.header
            await send(message)

        if given is not None and not _VALID.fullmatch(given):
            request_id = RequestId.mint()
            response = error(400, f"{HEADER}: 1 to {MAX_LENGTH} visible ASCII characters, no quotes or "
                                  "backslashes", param=HEADER)
            await response(scope, receive, send_with_id)
            return
        scope.setdefault("state", {})["request_id"] = request_id
        token = current_request_id.set(request_id.header)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current_request_id.reset(token)


def install_log_prefix() -> None:
    """Prefix every log record made while a request is served with `[its X-Request-Id]` (idempotent; the
    record factory is process-wide, so it reaches every logger and handler, uvicorn's access log too)."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "adds_request_id", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        request_id = current_request_id.get()
        if request_id:
            record.msg = f"[{request_id}] {record.msg}"
        return record

    factory.adds_request_id = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
