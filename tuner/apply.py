"""`pdserve tune plan --apply URL`: set a layout on a live gateway through its admin API (HTTP only).

    check_model: GET /v1/models (API key) — a plan made from another model's profile is refused here
    apply_layout: PUT /admin/pools {"prefill", "decode", "mixed"} (admin key, gateway/api/admin.py) — the
      gateway flips and adds/drains workers one at a time and answers when done, or with 4xx before any move
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

# Adding a worker loads a model: a resize may take minutes before PUT /admin/pools answers.
RESIZE_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 30.0


class ServerError(RuntimeError):
    """The server refused or failed a call; the message carries its status and answer."""


@dataclass(frozen=True)
class ServerAccess:
    url: str  # the gateway's base URL
    api_key: str | None = None  # Bearer token of /v1 routes and /metrics
    admin_key: str | None = None  # Bearer token of /admin routes (a loopback server without one needs none)

    def headers(self, *, is_admin: bool) -> dict[str, str]:
        key = self.admin_key if is_admin else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def _answer(response: httpx.Response) -> dict[str, object]:
    if response.status_code >= 400:
        raise ServerError(f"{response.request.method} {response.request.url.path}: HTTP "
                          f"{response.status_code}: {response.text[:500]}")
    data = response.json()
    if not isinstance(data, dict):
        raise ServerError(f"{response.request.url.path}: expected a JSON object, got {type(data).__name__}")
    return data


def served_models(access: ServerAccess) -> list[str]:
    response = httpx.get(f"{access.url}/v1/models", headers=access.headers(is_admin=False),
                         timeout=REQUEST_TIMEOUT_S)
    return [str(m["id"]) for m in _answer(response).get("data", [])]  # type: ignore[attr-defined]


def check_model(access: ServerAccess, model: str) -> None:
    """Raises ValueError when the server does not serve `model` (the plan's profile is of another one)."""
    models = served_models(access)
    if model not in models:
        raise ValueError(f"the profile is of model {model!r} but {access.url} serves {', '.join(models)}: "
                         "profile the server's model (pdserve tune profile --model DIR) and plan again")


def current_layout(access: ServerAccess) -> dict[str, int]:
    response = httpx.get(f"{access.url}/admin/pools", headers=access.headers(is_admin=True),
                         timeout=REQUEST_TIMEOUT_S)
    data = _answer(response)
    return {kind: int(data.get(kind, 0)) for kind in ("prefill", "decode", "mixed")}  # type: ignore[call-overload]


def apply_layout(access: ServerAccess, layout: dict[str, int]) -> dict[str, object]:
    """PUT the layout and wait until the gateway has applied it; returns its answer.

    Raises:
        ServerError: refused (4xx, e.g. a torch-backend deployment cannot resize) or the resize failed.
    """
    body = {kind: int(layout.get(kind, 0)) for kind in ("prefill", "decode", "mixed")}
    response = httpx.put(f"{access.url}/admin/pools", json=body, headers=access.headers(is_admin=True),
                         timeout=RESIZE_TIMEOUT_S)
    answer = _answer(response)
    if answer.get("error"):
        raise ServerError(f"PUT /admin/pools {body}: stopped part way: {answer['error']}")
    return answer
