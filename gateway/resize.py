"""Setting the pool layout at runtime (`PUT /admin/pools`): plan, check, then apply one worker at a time.

    PoolLayout (the body) → check(): can it serve? can the backend resize? does Ray have room? → 4xx if not
      → plan_moves(): workers to add, then workers to drain (adds first, so capacity never dips below the
        smaller of the two layouts) → apply(): each move in turn; a drain ends only when the worker holds
        no request in any state and the gateway has nothing in flight to it → ResizeResult.
One resize at a time: a second PUT while one applies is a ResizeConflict (409), as is any resize of a
torch-backend deployment (its process group is fixed at start). Kinds: prefill, decode, and mixed (a worker
that prefills its own requests and decodes them: the colocated layout).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import ray
from pydantic import BaseModel, ConfigDict, Field

from gateway.pools import PDDeployment
from gateway.router import Router
from gateway.workers import KIND_NAMES
from kv_transfer import capabilities

logger = logging.getLogger(__name__)

_KIND_OF = {name: kind for kind, name in KIND_NAMES.items()}  # the body's names → the deployment's kinds


class PoolLayout(BaseModel):
    """The body of PUT /admin/pools: how many workers of each kind the deployment should have."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prefill: int = Field(ge=0, le=1024)
    decode: int = Field(ge=0, le=1024)
    mixed: int = Field(default=0, ge=0, le=1024)

    def by_kind(self) -> dict[str, int]:
        return {_KIND_OF[name]: count for name, count in self.model_dump().items()}


class ResizeRefused(Exception):
    """The layout cannot be applied (HTTP 400); nothing has moved."""


class ResizeConflict(Exception):
    """Another resize is applying, or the backend cannot resize (HTTP 409); nothing has moved."""


@dataclass(frozen=True)
class Move:
    action: str  # "add" or "drain"
    kind: str  # "prefill", "decode" or "colocated"


@dataclass
class ResizeResult:
    """What PUT /admin/pools answers."""

    moves: list[Move]  # the plan, in order
    done: list[str] = field(default_factory=list)  # "added decode-5", "drained prefill-0", one per move
    error: str = ""  # why the plan stopped part way (a worker failed to start, a drain timed out)
    seconds: float = 0.0


def plan_moves(current: dict[str, int], target: dict[str, int]) -> list[Move]:
    """Adds first, then drains, one worker per move."""
    adds = [Move("add", kind) for kind in target for _ in range(target[kind] - current.get(kind, 0))]
    drains = [Move("drain", kind) for kind in target for _ in range(current.get(kind, 0) - target[kind])]
    return adds + drains


class PoolResizer:
    def __init__(self, deployment: PDDeployment, router: Router, drain_timeout_s: float = 300.0) -> None:
        self.deployment = deployment
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()
        self.current_plan: ResizeResult | None = None  # the resize applying now, for GET /admin/pools

    def check(self, layout: PoolLayout) -> list[Move]:
        """The moves to reach `layout`, or ResizeRefused / ResizeConflict saying why not."""
        if capabilities(self.deployment.backend).needs_peer_bound_up_front:
            raise ResizeConflict(f"the {self.deployment.backend} transfer backend fixes its workers when the "
                                 "server starts; serve with --backend nixl to change the pools at runtime")
        if self._lock.locked():
            raise ResizeConflict("another change of the pools is being applied; try again when it is done")
        target = layout.by_kind()
        if target["prefill"] + target["colocated"] < 1 or target["decode"] + target["colocated"] < 1:
            raise ResizeRefused("the layout cannot serve: it needs at least one worker that can prefill "
                                "(prefill or mixed) and one that can decode (decode or mixed)")
        if (target["prefill"] or target["decode"]) and self.deployment.backend.value == "local":
            raise ResizeConflict("this server was started with only mixed workers and no KV transfer "
                                 "backend; serve with --backend nixl to add prefill or decode workers")
        moves = plan_moves(self.deployment.target, target)
        num_added = sum(move.action == "add" for move in moves)
        cpus = num_added * self.deployment.config.num_cpus_per_worker
        available = ray.available_resources().get("CPU", 0.0)
        if cpus > available:
            raise ResizeRefused(f"the layout needs {num_added} more workers ({cpus:g} CPUs) but the Ray "
                                f"cluster has {available:g} CPUs free")
        return moves

    async def apply(self, moves: list[Move]) -> ResizeResult:
        """Carry out the moves in order; stops at the first that fails (the rest do not run)."""
        if self._lock.locked():
            raise ResizeConflict("another change of the pools is being applied; try again when it is done")
        async with self._lock:
            result = ResizeResult(moves)
            self.current_plan = result
            started = time.monotonic()
            try:
                for move in moves:
                    if move.action == "add":
                        worker_id = await self.deployment.add_worker(move.kind)
                        result.done.append(f"added {worker_id}")
                    else:
                        worker_id = self._pick_to_drain(move.kind)
                        await self.deployment.drain_worker(worker_id, timeout_s=self.drain_timeout_s,
                                                           in_flight=self.router.in_flight)
                        result.done.append(f"drained {worker_id}")
                    logger.info("pools: %s", result.done[-1])
            except Exception as error:
                result.error = f"{type(error).__name__}: {error}"
                logger.error("pools: the resize stopped after %d of %d moves: %s", len(result.done),
                             len(moves), result.error)
            finally:
                result.seconds = time.monotonic() - started
                self.current_plan = None
            return result

    def _pick_to_drain(self, kind: str) -> str:
        """The newest active worker of that kind (the oldest keep their warm prefix caches)."""
        candidates = [w for w in self.deployment.workers.values() if w.kind == kind and w.is_active]
        if not candidates:
            raise RuntimeError(f"no active {kind} worker to drain")
        return candidates[-1].worker_id
