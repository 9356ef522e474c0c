"""ChaosConfig, the settings of one chaos run, and ChaosTarget, the server it runs against."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ChaosConfig:
    duration_s: float = 300.0  # seconds of traffic and faults
    seed: int = 0
    rate: float = 3.0  # requests/s, Poisson
    cancel_fraction: float = 0.15  # clients that leave (before the first token, after some, or give up)
    stall_fraction: float = 0.1  # streaming clients that stop reading for a while (then resume or leave)
    greedy_fraction: float = 0.4  # requests compared token for token with transformers' greedy output
    long_fraction: float = 0.25  # prompts of 300-700 tokens (else 4-64)
    max_greedy_tokens: int = 96  # the reference's length; a greedy request asks for at most this many
    num_greedy_prompts: int = 12
    # Faults: one every [fault_min_s, fault_max_s]; the first busy-worker kill at first_kill_s.
    fault_min_s: float = 3.0
    fault_max_s: float = 9.0
    first_kill_s: float = 8.0
    skip_faults: tuple[str, ...] = ()  # fault kinds never drawn (driver.WEIGHTS), e.g. a known bug's trigger
    max_workers: int = 3  # a random layout has 2..max_workers workers
    drain_timeout_s: float = 300.0  # the resizer's drain timeout (gateway/ratio/resize.py PoolResizer)
    # Bounds: a worker may stay outside `active` this long (plus the grace of the change moving it).
    state_bound_s: float = 60.0
    # ... but a worker being placed and loading its model (pending → starting, a replacement) this long: a
    # model load on a loaded 2-core machine takes longer than a role change, and is not a stuck worker.
    start_bound_s: float = 120.0
    settle_s: float = 60.0  # at the end: for the layout, /health and 0 used KV blocks
    hang_grace_s: float = 30.0  # a request still open this long past its server deadline is hung
    watch_every_s: float = 0.5
    # The server's deadline policy, as it was started (gateway/requests/deadlines.py's defaults).
    deadline_slack_s: float = 60.0
    deadline_prefill_s_per_token: float = 0.02
    deadline_decode_s_per_token: float = 1.0
    rss_growth_limit_mib: float | None = 256.0  # gateway RSS growth first → last sample; None: not checked
    api_key: str | None = None  # Bearer key of /v1 and /metrics, when the server has one
    # The deployed configuration (--api-server-count N --fleet-name): N > 1 draws the frontend and fleet
    # faults too (driver.FRONTENDS_ONLY), and every request opens its own connection (spread over them).
    num_frontends: int = 1
    min_each_fault: int = 0  # each drawable kind at least this often, where the run's time allows
    health_down_s: float = 15.0  # the fleet actor killed: /health answers 503 within this
    fleet_recovery_s: float = 120.0  # ... and 200 again (the fleet and its workers started) within this
    replacement_window_s: float = 30.0  # a worker replaced up to this long after a fault that may kill one

    @property
    def has_frontends(self) -> bool:
        return self.num_frontends > 1

    def deadline_s(self, num_prompt_tokens: int, max_tokens: int) -> float:
        """The server's bound on a request's last token after its arrival, plus the hang grace."""
        return (2 * self.deadline_slack_s + num_prompt_tokens * self.deadline_prefill_s_per_token
                + max_tokens * self.deadline_decode_s_per_token + self.hang_grace_s)


def _no_pids() -> list[int]:
    return []


def _no_pid() -> int | None:
    return None


@dataclass(frozen=True)
class ChaosTarget:
    """The server under test and the processes the run may touch."""

    url: str
    model_dir: Path  # for the greedy reference
    gateway_pid: int  # whose RSS is sampled (with the frontends')
    owns: Callable[[int], bool]  # whether a pid belongs to this run's server (only those are ever killed)
    frontend_pids: Callable[[], list[int]] = _no_pids  # the frontend processes now (N > 1 only)
    fleet_pid: Callable[[], int | None] = _no_pid  # the fleet actor's process now (N > 1 only)
    ray_address: str | None = None  # the run's own Ray cluster (the worker faults join it as a driver)
    # restart_supervisor: stop the server and start it again with these extra flags; returns the seconds
    # until /health said ok. None: the run cannot (the fault is skipped).
    restart_server: Callable[[tuple[str, ...]], float] | None = None
    server_pid: Callable[[], int | None] | None = None  # the supervisor's pid now (it changes on a restart)
    server_log: Path | None = None

    def gateway_pid_now(self) -> int:
        pid = self.server_pid() if self.server_pid is not None else None
        return pid if pid is not None else self.gateway_pid
