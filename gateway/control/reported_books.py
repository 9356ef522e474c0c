"""ReportedBooks: the routers' counts summed over every live frontend (RoutingBooks for the fleet actor's
controller and resizer).

    report(FrontendReport) twice a second from each frontend → the sums the controller reads
    heard(frontend_id): each frontend's heartbeat, sent from its own thread twice a second (its event loop may
              be busy for seconds: a burst of schema checks, a large body; the heartbeat still comes)
    expire(): a frontend not heard for FRONTEND_SILENT_S is taken for dead (its process died or is paused):
              its counts are dropped and its id returned (the fleet actor then has every worker end that
              frontend's output channels; if it was only paused, it resumes its requests when it wakes).
              Called every second: a call that comes FLEET_STALL_S late finds the fleet itself was
              paused (the heartbeats sent meanwhile may still wait in its queue): it expires nobody, and
              every frontend's silence counts from then.
    forget(prefixes): the same at once, for frontends whose process its supervisor saw exit
admission_share(frontend_id, total, floor): the decode KV tokens that frontend may reserve, from the one
    capacity of the fleet: what each live frontend holds now stays its own; the rest goes to the frontends
    whose lines wait, in proportion to what they wait for (evenly when none waits), never below `floor`
    (one request's worth). Renewed with every report (a lease of 0.5 s): a frontend whose clients' connections
    pin their requests to it gets the capacity the others leave idle.
Setting local_prefill (the controller does, as it turns on and off) calls on_policy: the fleet publishes a
new snapshot, and every frontend's router takes the policy from it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from gateway.control.messages import FrontendReport
from gateway.requests.router import LocalPrefillPolicy

FRONTEND_SILENT_S = 10.0  # heartbeats come every 0.5 s: twenty missed in a row
FLEET_STALL_S = 3.0  # expire() comes every second: this late, the fleet actor was paused or stalled


class ReportedBooks:
    def __init__(self, local_prefill: LocalPrefillPolicy, on_policy: Callable[[], None]) -> None:
        self._local_prefill = local_prefill
        self._on_policy = on_policy
        self.on_local_prefill: list[Callable[[int], None]] = []  # frontends tell the fleet directly
        self._reports: dict[str, FrontendReport] = {}  # frontend id → its latest report
        self._heard: dict[str, float] = {}  # frontend id → when it last reported or sent a heartbeat
        self._last_expiry = time.monotonic()

    @property
    def local_prefill(self) -> LocalPrefillPolicy:
        return self._local_prefill

    @local_prefill.setter
    def local_prefill(self, policy: LocalPrefillPolicy) -> None:
        if policy != self._local_prefill:
            self._local_prefill = policy
            self._on_policy()

    def report(self, report: FrontendReport) -> None:
        self._reports[report.frontend_id] = report
        self.heard(report.frontend_id)

    def heard(self, frontend_id: str) -> bool:
        """The frontend is alive; returns whether it was known (False: new, or taken for dead since)."""
        is_known = frontend_id in self._heard
        self._heard[frontend_id] = time.monotonic()
        return is_known

    def frontends(self) -> list[str]:
        return list(self._heard)

    def expire(self) -> list[str]:
        """Drop the frontends not heard for FRONTEND_SILENT_S; returns their ids. None after a stall of
        the fleet's own (review P9: a pause past the lease would otherwise expire every frontend at once)."""
        now = time.monotonic()
        was_stalled, self._last_expiry = now - self._last_expiry > FLEET_STALL_S, now
        if was_stalled:
            self._heard = dict.fromkeys(self._heard, now)
            return []
        return self._drop([f for f, at in self._heard.items() if now - at > FRONTEND_SILENT_S])

    def forget(self, prefixes: list[str]) -> list[str]:
        """Drop the frontends whose id starts with one of `prefixes` (processes their supervisor saw exit),
        at once rather than after FRONTEND_SILENT_S; returns their ids."""
        return self._drop([f for f in self._heard if f.startswith(tuple(prefixes))])

    def _drop(self, frontend_ids: list[str]) -> list[str]:
        for frontend_id in frontend_ids:
            del self._heard[frontend_id]
            self._reports.pop(frontend_id, None)
        return frontend_ids

    def admission_share(self, frontend_id: str, total: int, floor: int) -> int:
        reports = list(self._reports.values())
        reserved = {r.frontend_id: r.reserved_tokens for r in reports}
        wanted = {r.frontend_id: r.waiting_tokens for r in reports}
        if frontend_id not in reserved:  # not reported yet: an even share beside the others
            return max(floor, total // (len(reports) + 1))
        free = max(0, total - sum(reserved.values()))
        num_wanted = sum(wanted.values())
        extra = free * wanted[frontend_id] // num_wanted if num_wanted else free // len(reports)
        return max(floor, reserved[frontend_id] + extra)

    def _sum(self, field: str) -> Counter[str]:
        total: Counter[str] = Counter()
        for report in self._reports.values():
            total.update(getattr(report, field))
        return total

    @property
    def prefill_tokens(self) -> Counter[str]:
        return self._sum("prefill_tokens")

    @property
    def local_prefill_tokens(self) -> Counter[str]:
        return self._sum("local_prefill_tokens")

    def in_flight(self, worker_id: str) -> int:
        return sum(report.in_flight.get(worker_id, 0) for report in self._reports.values())

    def on_the_way(self, worker_id: str) -> str:
        frontends = sorted(f for f, report in self._reports.items() if report.in_flight.get(worker_id))
        return f"reported by {', '.join(frontends)}"

    def longest_local_prefill(self) -> int:
        return max((r.longest_local_prefill for r in self._reports.values()), default=0)

    def longest_prefill_beside_streams(self) -> int:
        return max((r.longest_prefill_beside_streams for r in self._reports.values()), default=0)
