"""What a request body must be before the app reads it: at most MAX_BODY_BYTES, and JSON.

A Content-Length over the limit is refused (413) before a byte is read; a body sent without one (chunked)
is counted as it arrives and refused once past the limit. A POST with a body that is not application/json
is refused (415): FastAPI would otherwise hand the raw bytes to validation and answer a puzzling 400.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.errors import error

# A prompt of 128K token ids is under 1 MiB of JSON; 4 MiB leaves room for long chat histories.
MAX_BODY_BYTES = 4 << 20


class BodyTooLarge(HTTPException):
    """Raised from receive(); FastAPI passes HTTPExceptions raised while reading the body to the handlers."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than the {max_bytes} bytes this server accepts")


def _is_json(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = media_type.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


class BodyGuard:
    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            response = error(413, str(BodyTooLarge(self.max_body_bytes).detail))
            await response(scope, receive, send)
            return
        has_body = (declared.isdigit() and int(declared) > 0) or "transfer-encoding" in headers
        content_type = headers.get("content-type", "")
        if scope["method"] == "POST" and has_body and not _is_json(content_type):
            got = repr(content_type[:100]) if content_type else "none"
            response = error(415, f"send the request body as JSON with 'Content-Type: application/json' "
                                  f"(got {got})")
            await response(scope, receive, send)
            return
        num_received = 0

        async def receive_at_most() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        await self.app(scope, receive_at_most, send)
