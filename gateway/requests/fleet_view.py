"""FleetView: what the request path needs of the fleet.

A frontend's mirror of the fleet that the fleet actor owns provides it (gateway/control/remote_fleet.py). The
router and the orchestrator read workers and states through it and report failures to it; they never change
a worker's state themselves. The service tells it of prompts, finished requests and arrivals: the fleet's
controller and planners read them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.fleet.workers import PoolHealth, Worker
from gateway.telemetry.timings import Timings
from gateway.telemetry.traffic import TrafficNote
from worker_runtime.roles import Role


class FleetView(Protocol):
    workers: dict[str, Worker]  # every worker the fleet knows, by id (any state)
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
        """A call to the worker failed: take it out of routing now (the fleet probes it, and replaces it if
        the probe confirms the failure)."""
        ...

    def health(self) -> PoolHealth: ...

    def note_prompt(self, num_tokens: int) -> None:
        """A prompt was routed, or a decode worker started prefilling one itself."""
        ...

    def note_finished(self, timings: Timings) -> None: ...

    def note_traffic(self, note: TrafficNote) -> None:
        """A request arrived (note.num_output None) or finished."""
        ...
