"""Keys: /v1 routes want the API key when one is set; /admin routes want the admin key, or, when none is
set, a server bound to loopback. Compared in constant time."""

from __future__ import annotations

import hmac

from fastapi import HTTPException, Request


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(given: str | None, expected: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


async def require_api_key(request: Request) -> None:
    expected = request.app.state.config.api_key
    if expected and not _matches(_bearer(request), expected):
        raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


async def require_admin(request: Request) -> None:
    config = request.app.state.config
    if config.admin_key:
        if not _matches(_bearer(request), config.admin_key):
            raise HTTPException(401, "missing or wrong admin key: send 'Authorization: Bearer <admin key>'")
    elif not config.is_loopback:
        raise HTTPException(403, "admin routes need --admin-key when the server is not bound to loopback")
