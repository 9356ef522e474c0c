"""The admin routes over a fake fleet owner (no Ray): their answers keep the plane's keys exactly (a key the
plane left out stays out, an explicit null stays null), and OpenAPI shows their schema."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.api.admin import router as admin_routes
from gateway.api.auth import require_admin
from gateway.control.plane import decision_summary
from gateway.ratio.ladder import Decision, Signals
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import Move, ResizeResult
from worker_runtime.roles import Role

SIGNALS = Signals(1, 2, 300, 4, 0.5, None, None, None, 0, 0, 99.0)
PENDING = {"worker_id": "w-2", "role": "decode", "state": "pending", "node_id": None, "node_ip": None,
           "pid": None, "tensor_parallel_size": 2, "pending_reason": "no node offers pdserve_decode: 1"}
ACTIVE = {"worker_id": "w-0", "role": "prefill", "state": "changing_role", "node_id": "n",
          "node_ip": "10.0.0.1", "pid": 7, "tensor_parallel_size": 1, "next_role": "mixed",
          "runtime": {"dtype": "float32", "cpu_ids": (0, 1)},
          "requests": 1, "running_requests": 1, "waiting_requests": 0, "queued_prompt_tokens": 0,
          "transferring": 0, "free_kv_blocks": 60, "used_kv_blocks": 4, "total_kv_blocks": 64,
          "total_kv_tokens": 1024}
RESULT = ResizeResult([Move("change", Role.MIXED, Role.PREFILL)], ["w-0: prefill → mixed"], "", 1.5)


class FakeControl:
    async def pools(self) -> dict[str, object]:
        planned = Decision(1.0, 0, 1, "plan", "better", SIGNALS, {"goodput": 2.0}, {})
        return {"prefill": 1, "decode": 0, "mixed": 0, "target": {"prefill": 1, "decode": 1, "mixed": 0},
                "tensor_parallel": {"prefill": 1, "decode": 2, "mixed": 2},
                "status": "degraded", "backend": "nixl", "torch_rendezvous": None, "pending": 1,
                "change_in_progress": dataclasses.asdict(RESULT), "auto": True, "queued_prompt_tokens": 5,
                "ratio_decisions": [decision_summary(Decision(0.5, 1, 0, "prefill_idle", "calm", SIGNALS)),
                                    decision_summary(planned)],
                "workers": [ACTIVE, PENDING]}

    async def put_pools(self, layout: PoolLayout) -> dict[str, object]:
        if layout.auto is not None:
            return {"auto": layout.auto}
        return {"layout": {role.value: n for role, n in layout.by_role().items()},
                "tensor_parallel": {"prefill": 1, "decode": 1, "mixed": 1}, **dataclasses.asdict(RESULT),
                "moves": [m.describe() for m in RESULT.moves]}

    async def steps(self, worker_id: str, since: float) -> list[dict[str, object]]:
        if worker_id != "w-0":
            raise KeyError(worker_id)
        return [{"start": since, "duration_s": 0.01, "num_decode_tokens": 1, "num_prompt_tokens": 0}]


def client() -> TestClient:
    app = FastAPI()
    app.include_router(admin_routes)
    app.dependency_overrides[require_admin] = lambda: None
    app.state.control = FakeControl()
    return TestClient(app)


def jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def test_answers_keep_the_planes_keys_exactly() -> None:
    import asyncio

    with client() as http:
        pools = http.get("/admin/pools").json()
        assert pools == jsonable(asyncio.run(FakeControl().pools()))
        assert "next_role" not in pools["workers"][1] and "requests" not in pools["workers"][1]
        assert pools["workers"][1]["node_id"] is None and "prediction" not in pools["ratio_decisions"][0]
        assert http.put("/admin/pools", json={"auto": False}).json() == {"auto": False}
        resized = http.put("/admin/pools", json={"prefill": 0, "decode": 1, "mixed": 1}).json()
        assert resized == {"layout": {"prefill": 0, "decode": 1, "mixed": 1},
                           "tensor_parallel": {"prefill": 1, "decode": 1, "mixed": 1},
                           "moves": [{"action": "change", "role": "mixed", "from": "prefill"}],
                           "done": ["w-0: prefill → mixed"], "error": "", "seconds": 1.5}
        steps = http.get("/admin/workers/w-0/steps", params={"since": 3.0}).json()
        assert steps["worker_id"] == "w-0" and steps["steps"][0]["start"] == 3.0
        assert http.get("/admin/workers/w-9/steps").status_code == 404


def test_openapi_shows_the_admin_answers() -> None:
    with client() as http:
        schema = http.get("/openapi.json").json()
    names = set(schema["components"]["schemas"])
    assert {"PoolsResponse", "WorkerView", "RatioDecision", "StepsResponse", "AutoResponse",
            "ResizeResponse"} <= names
    get_pools = schema["paths"]["/admin/pools"]["get"]["responses"]["200"]["content"]["application/json"]
    assert get_pools["schema"] == {"$ref": "#/components/schemas/PoolsResponse"}
