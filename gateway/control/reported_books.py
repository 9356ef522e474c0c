"""ReportedBooks: the routers' counts summed over every live frontend (RoutingBooks for the fleet actor's
controller and resizer).

    report(FrontendReport) twice a second from each frontend → the sums the controller reads
    heard(frontend_id): each frontend's heartbeat, sent from its own thread twice a second (its event loop may
              be busy for seconds: a burst of schema checks, a large body; the heartbeat still comes)
    expire(): a frontend not heard for FRONTEND_SILENT_S is taken for dead (its process died or is paused):
              its counts are dropped and its id returned (the fleet actor then has every worker end that
              frontend's output channels; if it was only paused, it resumes its requests when it wakes)
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


class ReportedBooks:
    def __init__(self, local_prefill: LocalPrefillPolicy, on_policy: Callable[[], None]) -> None:
        self._local_prefill = local_prefill
        self._on_policy = on_policy
        self.on_local_prefill: list[Callable[[int], None]] = []  # frontends tell the fleet directly
        self._reports: dict[str, FrontendReport] = {}  # frontend id → its latest report
        self._heard: dict[str, float] = {}  # frontend id → when it last reported or sent a heartbeat

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
        """Drop the frontends not heard for FRONTEND_SILENT_S; returns their ids."""
        now = time.monotonic()
        gone = [f for f, at in self._heard.items() if now - at > FRONTEND_SILENT_S]
        for frontend_id in gone:
            del self._heard[frontend_id]
            self._reports.pop(frontend_id, None)
        return gone

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

    def longest_local_prefill(self) -> int:
        return max((r.longest_local_prefill for r in self._reports.values()), default=0)

    def longest_prefill_beside_streams(self) -> int:
        return max((r.longest_prefill_beside_streams for r in self._reports.values()), default=0)
