"""Admin routes (admin key, or loopback without one): read and set the pool layout.

GET /admin/pools  each worker's role, state, Ray node and load; the layout aimed at; a change in progress;
                  the ratio controller's state and its recent decisions.
PUT /admin/pools  {"prefill": N, "decode": M, "mixed": K} → checked (4xx before anything moves), then
                  applied one worker at a time (gateway/ratio/resize.py); answers the plan and what was done.
"""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Request

from gateway.api.auth import require_admin
from gateway.api.errors import documented
from gateway.ratio.controller import Decision, RatioController
from gateway.ratio.resize import PoolLayout, PoolResizer
from gateway.requests.service import GatewayService

router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])


def decision_summary(decision: Decision) -> dict[str, object]:
    return {"at": decision.at, "from_level": decision.from_level, "to_level": decision.to_level,
            "reason": decision.reason, "detail": decision.detail,
            "queued_prompt_tokens": decision.signals.queued_prompt_tokens}


@router.get("/pools", responses=documented(401, 403))
async def get_pools(request: Request) -> dict[str, object]:
    service: GatewayService = request.app.state.service
    resizer: PoolResizer = request.app.state.resizer
    controller: RatioController = request.app.state.controller
    deployment = service.deployment
    loads = {x.worker_id: x for x in await deployment.loads()}
    pools = deployment.health()
    workers: list[dict[str, object]] = []
    for worker in list(deployment.workers.values()):
        entry: dict[str, object] = {"worker_id": worker.worker_id, "role": worker.role.value,
                                    "state": worker.state.value,
                                    "node_id": worker.node_id, "node_ip": worker.node_ip,  # None: pending
                                    "pid": worker.pid}
        if worker.next_role is not None:
            entry["next_role"] = worker.next_role.value
        if worker.runtime is not None:  # dtype, GEMM kernel, threads, cores, KV bytes per token
            entry["runtime"] = dataclasses.asdict(worker.runtime)
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
        **pools.active,
        "target": pools.target,
        "status": pools.status,
        "backend": deployment.backend.value,
        "torch_rendezvous": deployment.torch_rendezvous,  # the torch group's init address (torch backend)
        "pending": pools.num_pending,  # workers no node can take yet
        "change_in_progress": None if change is None else dataclasses.asdict(change),
        "auto": controller.is_on,
        "queued_prompt_tokens": controller.queued_prompt_tokens(),  # routed, not yet prefilled
        "ratio_decisions": [decision_summary(d) for d in list(controller.decisions)[-20:]],
        "workers": workers,
    }


@router.put("/pools", responses=documented(400, 401, 403, 409))
async def put_pools(layout: PoolLayout, request: Request) -> dict[str, object]:
    resizer: PoolResizer = request.app.state.resizer
    controller: RatioController = request.app.state.controller
    if layout.auto is not None:
        if layout.auto and not resizer.deployment.can_change:
            resizer.check(layout)  # the same 409 as any change on a fixed torch group
        if layout.auto:
            controller.start()
        else:
            await controller.stop()  # a change it was applying is rolled back first
        return {"auto": controller.is_on}
    moves = resizer.check(layout)  # ResizeRefused (400) / ResizeConflict (409) before anything moves
    await controller.stop()  # a layout set by hand stays until the operator turns auto back on
    result = await resizer.apply(moves, layout.drain_grace_s)
    return {"layout": {role.value: n for role, n in layout.by_role().items()}, **dataclasses.asdict(result),
            "moves": [m.describe() for m in result.moves]}
