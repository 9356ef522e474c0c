"""Admin routes (admin key, or loopback without one): read and set the pool layout.

GET /admin/pools  each worker's kind, state and load; the layout aimed at; a change in progress.
PUT /admin/pools  {"prefill": N, "decode": M, "mixed": K} → checked (4xx before anything moves), then
                  applied one worker at a time (gateway/resize.py); answers the plan and what was done.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request

from gateway.auth import require_admin
from gateway.errors import documented
from gateway.resize import PoolLayout, PoolResizer
from gateway.service import GatewayService
from gateway.workers import KIND_NAMES

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


@router.get("/pools", responses=documented(401, 403))
async def get_pools(request: Request) -> dict[str, object]:
    service: GatewayService = request.app.state.service
    resizer: PoolResizer = request.app.state.resizer
    deployment = service.deployment
    loads = {x.worker_id: x for x in await deployment.loads()}
    pools = deployment.health()
    workers: list[dict[str, object]] = []
    for worker in list(deployment.workers.values()):
        entry: dict[str, object] = {"worker_id": worker.worker_id, "kind": KIND_NAMES[worker.kind],
                                    "role": worker.role, "state": worker.state.value}
        load = loads.get(worker.worker_id)
        if load is not None:
            entry |= {"requests": load.num_requests, "running_requests": load.num_running,
                      "waiting_requests": load.num_waiting,
                      "queued_prompt_tokens": load.num_queued_prompt_tokens,
                      "transferring": load.num_transferring, "free_kv_blocks": load.num_free_blocks,
                      "used_kv_blocks": load.num_total_blocks - load.num_free_blocks,
                      "total_kv_blocks": load.num_total_blocks}
        workers.append(entry)
    change = resizer.current_plan
    return {
        **{KIND_NAMES[kind]: count for kind, count in pools.active.items()},
        "target": {KIND_NAMES[kind]: count for kind, count in pools.target.items()},
        "status": pools.status,
        "backend": deployment.backend.value,
        "change_in_progress": None if change is None else dataclasses.asdict(change),
        "workers": workers,
    }


@router.put("/pools", responses=documented(400, 401, 403, 409))
async def put_pools(layout: PoolLayout, request: Request) -> dict[str, object]:
    resizer: PoolResizer = request.app.state.resizer
    moves = resizer.check(layout)  # ResizeRefused (400) / ResizeConflict (409) before anything moves
    result = await resizer.apply(moves)
    return {"layout": layout.model_dump(), **dataclasses.asdict(result),
            "moves": [{"action": m.action, "kind": KIND_NAMES[m.kind]} for m in result.moves]}
