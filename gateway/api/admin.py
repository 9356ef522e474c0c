"""Admin routes (admin key, or loopback without one): read and set the pool layout.

GET /admin/pools  each worker's role, state, Ray node, load and KV capacity (total_kv_blocks,
                  total_kv_tokens; its runtime says how the KV memory was sized); the layout aimed at; a
                  change in progress; the ratio controller's state and its recent decisions.
GET /admin/workers/{id}/steps  the worker's recent forwards: start, duration, decode and prompt tokens.
PUT /admin/pools  {"prefill": N, "decode": M, "mixed": K} → checked (4xx before anything moves), then
                  applied one worker at a time (gateway/ratio/resize.py); answers the plan and what was done.
Both are the fleet owner's (gateway/control/plane.py), in the fleet actor that every frontend shares. Their
answers' models: gateway/api/admin_protocol.py (in the OpenAPI schema).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request

from gateway.api.admin_protocol import AutoResponse, PoolsResponse, ResizeResponse, StepsResponse
from gateway.api.auth import require_admin
from gateway.api.errors import documented
from gateway.control.plane import FleetControl
from gateway.ratio.pool_layout import PoolLayout

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/pools", responses=documented(401, 403), response_model_exclude_unset=True)
async def get_pools(request: Request) -> PoolsResponse:
    control: FleetControl = request.app.state.control
    return PoolsResponse.model_validate(await control.pools())


@router.get("/workers/{worker_id}/steps", responses=documented(401, 403, 404))
async def worker_steps(worker_id: str, request: Request, since: float = 0.0) -> StepsResponse:
    """The worker's recent forwards (the last few thousand), each with its start (Unix time), duration and
    decode and prompt tokens: where a stream's gap came from. `since`: only those that started after it."""
    control: FleetControl = request.app.state.control
    try:
        return StepsResponse(worker_id=worker_id, steps=await control.steps(worker_id, since))
    except KeyError:
        raise HTTPException(404, f"no worker {worker_id!r} (GET /admin/pools lists them)") from None


@router.put("/pools", responses=documented(400, 401, 403, 409))
async def put_pools(layout: PoolLayout, request: Request) -> AutoResponse | ResizeResponse:
    control: FleetControl = request.app.state.control
    answer = await control.put_pools(layout)
    return AutoResponse.model_validate(answer) if "auto" in answer else ResizeResponse.model_validate(answer)
