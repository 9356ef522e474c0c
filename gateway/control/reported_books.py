"""ReportedBooks: the routers' counts summed over every live frontend (RoutingBooks for the fleet actor's
controller and resizer).

    report(FrontendReport) twice a second from each frontend → the sums the controller reads
    expire(): a frontend silent for FRONTEND_SILENT_S is taken for dead: its counts are dropped and its id
              returned (the fleet actor then has every worker end that frontend's output channels)
Setting local_prefill (the controller does, as it turns on and off) calls on_policy: the fleet publishes a
new snapshot, and every frontend's router takes the policy from it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from gateway.control.messages import FrontendReport
from gateway.requests.router import LocalPrefillPolicy

FRONTEND_SILENT_S = 5.0  # reports come every 0.5 s: ten missed in a row


class ReportedBooks:
    def __init__(self, local_prefill: LocalPrefillPolicy, on_policy: Callable[[], None]) -> None:
        self._local_prefill = local_prefill
        self._on_policy = on_policy
        self.on_local_prefill: list[Callable[[int], None]] = []  # frontends tell the fleet directly
        self._reports: dict[str, tuple[FrontendReport, float]] = {}  # frontend id → (latest, when)

    @property
    def local_prefill(self) -> LocalPrefillPolicy:
        return self._local_prefill

    @local_prefill.setter
    def local_prefill(self, policy: LocalPrefillPolicy) -> None:
        if policy != self._local_prefill:
            self._local_prefill = policy
            self._on_policy()

    def report(self, report: FrontendReport) -> None:
        self._reports[report.frontend_id] = (report, time.monotonic())

    def frontends(self) -> list[str]:
        return list(self._reports)

    def expire(self) -> list[str]:
        """Drop the frontends silent for FRONTEND_SILENT_S; returns their ids."""
        now = time.monotonic()
        gone = [f for f, (_, at) in self._reports.items() if now - at > FRONTEND_SILENT_S]
        for frontend_id in gone:
            del self._reports[frontend_id]
        return gone

    def _sum(self, field: str) -> Counter[str]:
        total: Counter[str] = Counter()
        for report, _ in self._reports.values():
            total.update(getattr(report, field))
        return total

    @property
    def prefill_tokens(self) -> Counter[str]:
        return self._sum("prefill_tokens")

    @property
    def local_prefill_tokens(self) -> Counter[str]:
        return self._sum("local_prefill_tokens")

    def in_flight(self, worker_id: str) -> int:
        return sum(report.in_flight.get(worker_id, 0) for report, _ in self._reports.values())

    def longest_local_prefill(self) -> int:
        return max((r.longest_local_prefill for r, _ in self._reports.values()), default=0)

    def longest_prefill_beside_streams(self) -> int:
        return max((r.longest_prefill_beside_streams for r, _ in self._reports.values()), default=0)
