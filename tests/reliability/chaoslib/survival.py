"""What survives what, from one chaos run's files: per fault kind, what the clients saw while it was under way
(their requests' outcomes and error codes) and how long until the server was healthy again.

    PYTHONPATH=$PWD .venv/bin/python -m tests.reliability.chaoslib.survival benchmarks/results/chaos/RUN

reads RUN/events.jsonl and RUN/requests.jsonl (or, without the latter, the request counts of summary.json
are left out) and prints a markdown table. A request counts for a fault when it ended while the fault was
under way or within AFTER_S after it. "Healthy again" is the first /health "ok" the watch saw after the
fault began, when /health had left "ok" meanwhile (the fleet kill's and the supervisor restart's own
measurements where they have one); "stayed ok" when it never left.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

AFTER_S = 10.0
# The event kinds that are faults, and the name the table gives them.
FAULTS = {"kill": "SIGKILL of a busy worker", "pause_worker": "SIGSTOP of a busy worker (8 s)",
          "hang_step": "a step that hangs (no error)", "step_error": "a step that raises",
          "query_of_death": "a query of death beside the traffic", "stall_pulls": "KV pulls that hang",
          "lost_release": "lost releases, 1 s leases (handles expire)",
          "mismatched_peer": "a peer with another KV layout", "forged_claim": "forged and stale KV claims",
          "kill_frontend": "SIGKILL of a frontend", "pause_frontend": "SIGSTOP of a frontend (4/6/12/15 s)",
          "loop_burst": "a loop-heavy burst (80 large schemas, MiB /tokenize)",
          "kill_fleet": "SIGKILL of the fleet actor", "pause_fleet": "SIGSTOP of the fleet actor (6/12 s)",
          "restart_supervisor": "the supervisor restarted (same / changed settings)",
          "salted_tenants": "one prompt as two tenants (cache salts)", "put": "a layout PUT / auto on-off"}


def _span(event: dict[str, Any]) -> tuple[float, float]:
    if event["kind"] == "put":
        return event["t_s"] - float(event.get("seconds") or 0.0), event["t_s"]
    return float(event.get("start_s", event["t_s"])), float(event.get("end_s", event["t_s"]))


def _healthy_again(events: list[dict[str, Any]], start: float) -> float | None:
    """Seconds from `start` to the first /health "ok" after /health left "ok"; 0.0: it never left it."""
    health = [e for e in events if e["kind"] == "health"]
    before = [e["status"] for e in health if e["t_s"] <= start]
    left = before[-1] != "ok" if before else False
    for event in (e for e in health if e["t_s"] > start):
        if event["status"] != "ok":
            left = True
        elif left:
            return event["t_s"] - start
        else:
            return 0.0
    return None if left else 0.0


def survival_rows(events: list[dict[str, Any]], requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for kind, name in FAULTS.items():
        faults = [e for e in events if e["kind"] == kind]
        if not faults:
            continue
        outcomes: Counter[str] = Counter()
        recoveries: list[float] = []
        for fault in faults:
            start, end = _span(fault)
            for request in requests:
                if start <= request["ended_s"] <= end + AFTER_S:
                    code = request["error_code"] if request["outcome"] == "error" else ""
                    outcomes[f"{request['outcome']}{' ' + code if code else ''}"] += 1
            measured = fault.get("to_healthy_s", fault.get("replaced_after_s"))
            back = float(measured) if measured is not None else _healthy_again(events, start)
            if back is not None:
                recoveries.append(back)
        rows.append({"fault": name, "kind": kind, "count": len(faults), "outcomes": dict(outcomes),
                     "healthy_again_s": {"median": statistics.median(recoveries) if recoveries else None,
                                         "max": max(recoveries) if recoveries else None,
                                         "measured": len(recoveries)}})
    return rows


def survival_md(rows: list[dict[str, Any]]) -> str:
    lines = ["| fault | times | requests ending meanwhile (+10 s): outcome, error code | healthy again after "
             "(s): median / max |", "|---|---:|---|---|"]
    for row in rows:
        outcomes = ", ".join(f"{k} {n}" for k, n in sorted(row["outcomes"].items(), key=lambda x: -x[1]))
        back = row["healthy_again_s"]
        when = ("never measured" if back["median"] is None else "stayed ok" if back["max"] == 0.0
                else f"{back['median']:.1f} / {back['max']:.1f}")
        lines.append(f"| {row['fault']} | {row['count']} | {outcomes or '—'} | {when} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    run = Path(sys.argv[1])
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line]
    requests_file = run / "requests.jsonl"
    requests = ([json.loads(line) for line in requests_file.read_text().splitlines() if line]
                if requests_file.is_file() else [])
    print(survival_md(survival_rows(events, requests)), end="")


if __name__ == "__main__":
    main()
