"""FleetView: what the request path needs of the fleet, whoever owns it.

Two things provide it: the fleet's owner itself (PDDeployment, in a gateway that runs one HTTP process) and a
frontend's mirror of a fleet owned elsewhere (gateway/control/remote_fleet.py: one of several HTTP processes,
the fleet in a named Ray actor). The router and the orchestrator read workers and states through it and
report failures to it; they never change a worker's state themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.fleet.workers import PoolHealth, Worker
from worker_runtime.roles import Role


class FleetView(Protocol):
    workers: dict[str, Worker]  # every worker the fleet knows, by id (any state)
    on_change: list[Callable[[], None]]  # called when the set of active workers changes
    on_remove: list[Callable[[str], None]]  # called with the id of a worker gone from its role

    @property
    def block_size(self) -> int:
        """Tokens per KV block (the workers' and the router's prefix hashes agree on it)."""
        ...

    def active(self, *roles: Role) -> list[Worker]:
        """Routable workers in any of `roles`."""
        ...

    def is_replacing(self, *roles: Role) -> bool:
        """Whether a worker in any of `roles` is being started in place of a failed one."""
        ...

    def mark_failed(self, worker_id: str, why: str) -> None:
        """A call to the worker failed: take it out of routing now (the owner replaces it)."""
        ...

    def health(self) -> PoolHealth: ...
