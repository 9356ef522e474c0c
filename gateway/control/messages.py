"""What crosses between the fleet actor and its frontends (each a plain dataclass, pickled by Ray).

    FleetInfo       once, when a frontend joins: the model and the KV each decode worker holds
    FleetSnapshot   the fleet as the request path needs it (workers, states, the router's policy), pulled
                    by each frontend whenever its version moves (a long poll)
    FrontendReport  twice a second from each frontend: its routers' counts and its finished requests' timings
                    (the controller's signals), and a heartbeat: a frontend silent for long is taken for dead
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.fleet.workers import PoolHealth
from gateway.requests.router import LocalPrefillPolicy
from gateway.telemetry.timings import Timings
from gateway.telemetry.traffic import TrafficNote


@dataclass(frozen=True)
class FleetInfo:
    model_dir: str
    kv_tokens_per_decode_worker: int  # the smallest decode or mixed worker's KV (less its watermark)
    block_size: int
    backend: str  # the KV transfer backend's name


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    role: str
    state: str  # gateway.fleet.workers.WorkerState's value
    next_role: str | None
    handle: Any  # the worker's Ray actor handle (frontends call it directly)


@dataclass(frozen=True)
class FleetSnapshot:
    epoch: str  # one per start of the fleet: a fleet actor restarted by Ray counts its versions anew
    version: int
    workers: tuple[WorkerEntry, ...]
    replacing: tuple[str, ...]  # roles with a failed worker's replacement starting
    health: PoolHealth
    local_prefill: LocalPrefillPolicy  # the routers' (the ratio controller sets it while it is on)
    long_prompt_tokens: int  # a prompt this long is told to the fleet at once (the controller wakes)


@dataclass(frozen=True)
class FrontendReport:
    frontend_id: str  # the frontend's gateway id: the prefix of its output channels on every worker
    in_flight: dict[str, int]  # worker id → tokens sent there and not yet back
    prefill_tokens: dict[str, int]
    local_prefill_tokens: dict[str, int]
    longest_local_prefill: int
    longest_prefill_beside_streams: int
    finished: list[Timings] = field(default_factory=list)  # requests finished since the last report
    traffic: list[TrafficNote] = field(default_factory=list)  # requests arrived or finished since then
    # Its admission book: decode KV tokens reserved by its running requests, and those its waiting line
    # asks for on top (the fleet leases each frontend its share of the one capacity from these).
    reserved_tokens: int = 0
    waiting_tokens: int = 0


def frontend_id(host: str, pid: int) -> str:
    """A frontend's id: its host and process (the supervisor that sees the process exit names it so:
    frontend_prefix), and a random part (a pid is reused in time)."""
    return f"{frontend_prefix(host, pid)}{uuid.uuid4().hex[:8]}"


def frontend_prefix(host: str, pid: int) -> str:
    return f"frontend-{host}-{pid}-"
