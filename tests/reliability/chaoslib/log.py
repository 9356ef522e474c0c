"""ChaosLog: the run's clock, what happened (driver actions, state changes) and the invariants broken."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChaosLog:
    start: float = field(default_factory=time.perf_counter)  # perf_counter when traffic started
    events: list[dict[str, Any]] = field(default_factory=list)  # {"t_s", "kind", ...}, in time order
    violations: list[dict[str, Any]] = field(default_factory=list)  # {"t_s", "invariant", "detail", ...}

    def now(self) -> float:
        return time.perf_counter() - self.start

    def event(self, kind: str, **detail: Any) -> dict[str, Any]:
        row = {"t_s": round(self.now(), 3), "kind": kind, **detail}
        self.events.append(row)
        return row

    def violate(self, invariant: str, detail: str, **context: Any) -> None:
        self.violations.append({"t_s": round(self.now(), 3), "invariant": invariant, "detail": detail,
                                **context})

    def recent(self, seconds: float = 30.0) -> list[dict[str, Any]]:
        """The driver's actions of the last `seconds`: what a violation's report shows as its cause."""
        since = self.now() - seconds
        return [e for e in self.events if e["t_s"] >= since and e["kind"] not in ("state", "health")]
