"""Keys: /v1 routes want the API key when one is set (and /metrics with --metrics-require-key: by default it
is open, as vLLM's, because Prometheus scrapers send no key); /admin routes want the admin key, or,
when none is set, a server bound to loopback and a request from loopback that no proxy forwarded (a
same-host reverse proxy or sidecar connects from loopback too, on behalf of anyone). Neither key opens the
other's routes. Compared in constant
time, both sides stripped of blanks. Both are Bearer tokens, declared as security schemes so the OpenAPI
description shows them.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Annotated

from fastapi import HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

# Headers a proxy adds when it forwards a request: their presence means the peer address is the proxy's.
_FORWARDED_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")

# auto_error=False: a missing or non-Bearer header reaches our check (and our 401), not FastAPI's 403.
_api_key = HTTPBearer(scheme_name="api_key", auto_error=False,
                      description="--api-key (/v1; /metrics with --metrics-require-key)")
_admin_key = HTTPBearer(scheme_name="admin_key", auto_error=False, description="--admin-key (/admin)")


def _matches(given: HTTPAuthorizationCredentials | None, expected: str) -> bool:
    # Both sides stripped: a key read from a file or a Kubernetes Secret often ends in a newline.
    token = given.credentials.strip() if given is not None else ""
    return bool(token) and hmac.compare_digest(token.encode(), expected.strip().encode())


async def require_api_key(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_api_key)]
) -> None:
    expected = request.app.state.config.api_key
    # `is not None`: a key that is empty (the config refuses one) locks everyone out rather than no one.
    if expected is not None and not _matches(credentials, expected):
        raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")


async def require_admin(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_admin_key)]
) -> None:
    config = request.app.state.config
    if config.admin_key:
        if not _matches(credentials, config.admin_key):
            raise HTTPException(401, "missing or wrong admin key: send 'Authorization: Bearer <admin key>'")
    elif not config.is_loopback:
        raise HTTPException(403, "admin routes need --admin-key when the server is not bound to loopback")
    elif not _is_direct_local(request):
        raise HTTPException(403, "admin routes without --admin-key answer only requests made on this host "
                                 "directly, not through a proxy")


def _is_direct_local(request: Request) -> bool:
    """The peer is this host, and no proxy says it forwarded the request for someone else."""
    if request.client is None or any(header in request.headers for header in _FORWARDED_HEADERS):
        return False
    try:
        return ipaddress.ip_address(request.client.host).is_loopback
    except ValueError:  # not an address (a Unix socket peer, a test transport): not known to be local
        return False
