"""Setting the pool layout at runtime (`PUT /admin/pools`): plan, check, then apply one worker at a time.

    PoolLayout (the body) → check(): can it serve? can the backend change? does Ray have room (or does the
      cluster autoscale: --autoscale-wait-s)? → 4xx if not
      → plan_moves(): role changes decode ⇄ mixed (instant: only the routing changes), then workers to add
        (all at once: each waits PENDING until Ray places it, so every resource demand reaches Ray's
        autoscaler together; one not placed within its wait is given up as unplaceable),
        then role changes to or from prefill (drain, then rebuild in place: same process, same weights),
        then workers to drain. Adds come before the moves that take a worker out of service, so capacity
        never dips below the smaller of the two layouts. A body that sets a role's tensor-parallel degree
        (prefill_tp, decode_tp) replaces the role's workers at another degree: the new degree's workers are
        added, then those drained (a worker's ranks are fixed for its life).
      → apply(): each move in turn; a drain ends only when the worker holds no request in any state and the
        gateway has nothing in flight to it (decode streams still there after a grace period move to
        other workers, losing no token) → ResizeResult.
One change at a time: a second PUT while one applies is a ResizeConflict (409), as is any change of a
torch-backend deployment (its process group is fixed at start).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import ray

from gateway.fleet.config import CANNOT_SERVE, DeploymentConfig, can_serve
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.drain import DRAIN_GRACE_S, DRAIN_TIMEOUT_S
from gateway.fleet.placement import PlacementTimeout, resource_request
from gateway.fleet.worker_errors import LastDecoder
from gateway.fleet.workers import WorkerState
from gateway.ratio.books import RoutingBooks
from gateway.ratio.pool_layout import PoolLayout
from worker_runtime.roles import Role

logger = logging.getLogger(__name__)


class ResizeRefused(Exception):
    """The layout cannot be applied (HTTP 400); nothing has moved."""


class ResizeConflict(Exception):
    """Another change is applying, or the backend cannot change (HTTP 409); nothing has moved."""


@dataclass(frozen=True)
class Move:
    action: str  # "add", "drain" or "change" (a worker changes role in place)
    role: Role  # the role added, drained, or changed to
    from_role: Role | None = None  # for "change": the role it leaves
    worker_id: str | None = None  # the worker to change or drain; None: the resizer picks

    def describe(self) -> dict[str, str]:
        described = {"action": self.action, "role": self.role.value}
        if self.from_role is not None:
            described["from"] = self.from_role.value
        return described


@dataclass
class ResizeResult:
    """What PUT /admin/pools answers."""

    moves: list[Move]  # the plan, in order
    done: list[str] = field(default_factory=list)  # "added worker-5", "worker-0: prefill → mixed", ...
    error: str = ""  # why the plan stopped part way (a worker failed to start, a drain timed out)
    seconds: float = 0.0


def plan_moves(current: dict[Role, int], target: dict[Role, int],
               can_change: Callable[[Role, Role], bool] = lambda a, b: True) -> list[Move]:
    """Role changes where one role has too many workers and another too few, then adds and drains for the
    rest, ordered as the module docstring says.

    Args:
        can_change: whether a worker may change from one role to the other in place (not between roles
            whose workers run different engines: a worker's ranks and KV cache are fixed at its start).
    """
    surplus = {role: current.get(role, 0) - target.get(role, 0) for role in Role}
    changes: list[Move] = []
    # decode ⇄ mixed first: free and instant. Then pair what is left.
    for pairs in (((Role.DECODE, Role.MIXED), (Role.MIXED, Role.DECODE)),
                  tuple((a, b) for a in Role for b in Role if a is not b)):
        for from_role, to_role in pairs:
            while surplus[from_role] > 0 and surplus[to_role] < 0 and can_change(from_role, to_role):
                changes.append(Move("change", to_role, from_role))
                surplus[from_role] -= 1
                surplus[to_role] += 1
    instant = [m for m in changes if m.role.can_decode and m.from_role is not None and m.from_role.can_decode]
    in_place = [m for m in changes if m not in instant]
    adds = [Move("add", role) for role in Role for _ in range(-surplus[role])]
    drains = [Move("drain", role) for role in Role for _ in range(surplus[role])]
    return instant + adds + in_place + drains


class PoolResizer:
    def __init__(self, deployment: PDDeployment, books: RoutingBooks,
                 drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        self.deployment = deployment
        self.books = books
        self.drain_timeout_s = drain_timeout_s
        self._lock = asyncio.Lock()
        self.current_plan: ResizeResult | None = None  # the change applying now, for GET /admin/pools

    @property
    def is_busy(self) -> bool:
        return self._lock.locked()

    def check(self, layout: PoolLayout) -> list[Move]:
        """The moves to reach `layout`, or ResizeRefused / ResizeConflict saying why not."""
        if not self.deployment.can_change:
            raise ResizeConflict(f"the {self.deployment.backend} transfer backend fixes its workers when the "
                                 "server starts; serve with --backend nixl to change the pools at runtime")
        if self.is_busy:
            raise ResizeConflict("another change of the pools is being applied; try again when it is done")
        if layout.drain_grace_s >= self.drain_timeout_s:  # every drain would time out before it evacuates
            raise ResizeRefused(f"drain_grace_s ({layout.drain_grace_s:g} s) must be below the drain timeout "
                                f"({self.drain_timeout_s:g} s)")
        target = layout.by_role()
        if not can_serve(target):
            raise ResizeRefused(f"the layout {CANNOT_SERVE}")
        if (target[Role.PREFILL] or target[Role.DECODE]) and self.deployment.backend.value == "local":
            raise ResizeConflict("this server was started with only mixed workers and no KV transfer "
                                 "backend; serve with --backend nixl to add prefill or decode workers")
        config = self.deployment.config
        role_tp = layout.role_tp(config)
        if role_tp is not None:
            self._check_degrees(layout)
            config = replace(config, role_tp=role_tp)
        # Workers at another degree than their role's new one are replaced: the rest of the plan counts
        # without them, and each is drained last.
        stale = [] if role_tp is None else [
            w for w in self.deployment.workers.values()
            if w.state not in (WorkerState.FAILED, WorkerState.STOPPED) and w.tp != config.tp_of(w.role)]
        if inactive := [w.worker_id for w in stale if not w.is_active]:
            raise ResizeConflict(f"the layout replaces {', '.join(inactive)}, which is not active yet; try "
                                 "again when GET /health says ok")
        current = dict(self.deployment.target)
        for worker in stale:
            current[worker.role] -= 1
        # A worker changes role only where both roles run the same engine (degree, KV cache type).
        moves = plan_moves(current, target, lambda a, b: config.engine_for(a) == config.engine_for(b))
        moves += [Move("drain", w.role, worker_id=w.worker_id) for w in stale]
        # The target counts workers still starting (a failed one's replacement, a PENDING one), but a role
        # change or a drain needs an ACTIVE worker of the role it takes from: refuse now rather than stop
        # part way through the plan.
        for role in Role:
            needed = sum((m.action == "drain" and m.role is role) or m.from_role is role for m in moves)
            active = len(self.deployment.active(role))
            if needed > active:
                raise ResizeConflict(f"the layout moves {needed} {role.value} worker(s) but only {active} "
                                     f"{'is' if active == 1 else 'are'} active (the others are starting or "
                                     "being replaced); try again when GET /health says ok")
        self._check_room([move.role for move in moves if move.action == "add"], config)
        return moves

    def _check_degrees(self, layout: PoolLayout) -> None:
        """Each degree the body sets splits the model's heads (ResizeRefused naming the field if not)."""
        for name, degree in (("prefill_tp", layout.prefill_tp), ("decode_tp", layout.decode_tp)):
            if degree is not None:
                try:
                    self.deployment.config.check_degree(degree, name)
                except ValueError as error:
                    raise ResizeRefused(str(error)) from None

    def _check_room(self, added: list[Role], config: DeploymentConfig) -> None:
        """Ray has every resource the added workers ask for (CPUs, GPUs, their role's custom resources, for
        all their ranks) free in total; otherwise the adds would stop part way, waiting for a placement
        (review L5)."""
        needed: dict[str, float] = {}
        for role in added:
            for name, amount in resource_request(config, role).items():  # all of a worker's ranks
                if amount:
                    needed[name] = needed.get(name, 0.0) + amount
        available = ray.available_resources()
        short = {name: (amount, available.get(name, 0.0)) for name, amount in needed.items()
                 if amount > available.get(name, 0.0) + 1e-9}
        if not short:
            return
        what = ", ".join(f"{amount:g} {name} ({free:g} free)"
                         for name, (amount, free) in sorted(short.items()))
        if config.autoscale_wait_s is not None:  # the autoscaler adds nodes for the pending workers' demands
            logger.info("pools: the layout needs %s; the new workers wait for nodes up to %g s", what,
                        config.autoscale_wait_s)
            return
        raise ResizeRefused(f"the layout needs {len(added)} more workers, asking for {what} from the Ray "
                            "cluster (where the cluster autoscales, serve with --autoscale-wait-s to let "
                            "them wait for new nodes)")

    async def apply(self, moves: list[Move], grace_s: float = DRAIN_GRACE_S,
                    placement_wait_s: float | None = None,
                    role_tp: dict[Role, int] | None = None) -> ResizeResult:
        """Carry out the moves in order; stops at the first that fails (the rest do not run).

        Args:
            grace_s: how long a leaving worker's decode streams may run on before they move elsewhere.
            placement_wait_s: how long an added worker may wait for a node (None: the deployment's own wait).
            role_tp: the degrees the layout sets (PoolLayout.role_tp), which the moves were planned for: the
                workers added (and any replacement from now on) start at them. Back to what they were if
                the plan stops before it added a worker.
        """
        if self.is_busy:
            raise ResizeConflict("another change of the pools is being applied; try again when it is done")
        async with self._lock:
            result = ResizeResult(moves)
            self.current_plan = result
            started = time.monotonic()
            degrees_before = dict(self.deployment.config.role_tp)
            if role_tp is not None:
                self.deployment.retune(role_tp)
            try:
                index = 0
                while index < len(moves):
                    adds = list(itertools.takewhile(lambda m: m.action == "add", moves[index:]))
                    if adds:
                        await self._add_all(adds, result, placement_wait_s)
                        index += len(adds)
                        continue
                    result.done.append(await self._apply_one(moves[index], grace_s))
                    logger.info("pools: %s", result.done[-1])
                    index += 1
            except Exception as error:
                # The answer names the move and the kind of failure only: a Ray error's text carries remote
                # tracebacks, actor ids and addresses (the log has it all). A placement timeout's and a
                # refused drain's texts are ours: what the workers ask for and what the live nodes offer;
                # which worker is the last that can decode.
                failed = moves[len(result.done)].describe()
                result.error = (f"the move {len(result.done) + 1} of {len(moves)} ({failed['action']} "
                                f"{failed['role']}) failed: {type(error).__name__}")
                if isinstance(error, PlacementTimeout):
                    result.error += f" (unplaceable, given up and its resources released: {error})"
                elif isinstance(error, LastDecoder):
                    result.error += f" ({error})"
                logger.exception("pools: the change stopped after %d of %d moves", len(result.done),
                                 len(moves))
                if role_tp is not None and not any(done.startswith("added ") for done in result.done):
                    self.deployment.retune(degrees_before)
            finally:
                result.seconds = time.monotonic() - started
                self.current_plan = None
            return result

    async def _add_all(self, adds: list[Move], result: ResizeResult, placement_wait_s: float | None) -> None:
        """Consecutive adds at once, so that Ray (and its autoscaler) sees every new worker's demand together
        rather than one node at a time; raises the first failure once all have ended (a failed add has
        already killed its actor and taken its target back)."""
        async def add(move: Move) -> None:
            result.done.append(f"added {await self.deployment.add_worker(move.role, placement_wait_s)}")
            logger.info("pools: %s", result.done[-1])

        outcomes = await asyncio.gather(*(add(move) for move in adds), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        if failures:
            raise failures[0]

    async def _apply_one(self, move: Move, grace_s: float) -> str:
        assert move.action != "add"  # adds go together (_add_all)
        if move.action == "drain":
            worker_id = move.worker_id or self._pick(move.role)
            await self.deployment.drain_worker(worker_id, books=self.books, grace_s=grace_s,
                                               timeout_s=self.drain_timeout_s)
            return f"drained {worker_id}"
        assert move.from_role is not None
        worker_id = move.worker_id or self._pick(move.from_role)
        await self.deployment.change_role(worker_id, move.role, books=self.books,
                                          grace_s=grace_s, timeout_s=self.drain_timeout_s)
        return f"{worker_id}: {move.from_role.value} → {move.role.value}"

    def _pick(self, role: Role) -> str:
        """The active worker of that role with the least work (ties: the newest; the oldest keep their
        warm prefix caches); one at the role's degree where there is one (those at another are drained by
        moves of their own)."""
        candidates = [w for w in self.deployment.workers.values() if w.role is role and w.is_active]
        if not candidates:
            raise RuntimeError(f"no active {role.value} worker")
        degree = self.deployment.config.tp_of(role)
        candidates = [w for w in candidates if w.tp == degree] or candidates
        held = {x.worker_id: x.num_requests for x in self.deployment.last_loads}
        return min(reversed(candidates), key=lambda w: held.get(w.worker_id, 0)).worker_id
