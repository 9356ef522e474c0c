"""The report of one chaos run: summary.json, summary.md, requests.jsonl and events.jsonl under --out.

Results are files (and the slow test's asserts), never a figure to tune against.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.reliability.chaoslib.run import WARMUP_S, ChaosResult
from tests.reliability.chaoslib.survival import survival_md, survival_rows
from tests.reliability.chaoslib.traffic import record_row
from tests.reliability.chaoslib.worker_faults import KINDS as WORKER_FAULT_KINDS


def summarize(result: ChaosResult) -> dict[str, Any]:
    records = result.records
    rss = [mib for _, mib in result.rss_mib]
    return {
        "model": result.model,
        "config": {k: v for k, v in asdict(result.config).items() if k != "api_key"},
        "requests": {
            "total": len(records),
            "by_outcome": dict(Counter(r.outcome for r in records)),
            "by_kind": {kind: dict(Counter(r.outcome for r in records if r.kind == kind))
                        for kind in sorted({r.kind for r in records})},
            "by_kind_and_outcome": dict(Counter(f"{r.kind}/{'stream' if r.is_stream else 'whole'}/"
                                                f"{r.behaviour}: {r.outcome}" for r in records)),
            "errors_by_code": dict(Counter(r.error_code for r in records if r.outcome == "error")),
            "greedy_checked": sum(r.kind == "greedy" and r.outcome in ("ok", "cancelled", "error")
                                  for r in records),
        },
        "faults": result.faults,
        "injected_by_kind": result.injected,
        "num_busy_kills": result.num_busy_kills,
        "frontends": {
            "num": result.config.num_frontends,
            "requests_seen_by_frontend": {str(pid): n for pid, n in result.requests_by_frontend.items()},
            "faults": [{"kind": c.kind, "pid": c.pid, "t_s": round(c.start_s, 2), "connections": len(c.ports),
                        "requests_cut": sum(r.cut_by == c.name for r in records)} for c in result.cuts],
            "requests_cut": sum(r.outcome == "cut" for r in records),
        },
        "fleet_kills": result.recoveries,
        "supervisor_restarts": result.restarts,
        "worker_faults": [e for e in result.log.events if e["kind"] in WORKER_FAULT_KINDS],
        "worker_rss_mib": result.worker_rss,
        "gateway_rss_by_process_mib": result.gateway_rss,
        "survival": survival_rows(result.log.events, [asdict(r) for r in result.records]),
        "departures": result.departures,
        "migrations": {"pdserve:migrations_total": result.counters.get("pdserve:migrations_total", 0),
                       "stream_moves_seen_by_clients": sum(r.num_moves or 0 for r in records),
                       "layout_moves_done": len(result.layout_moves)},
        "expected_layout": result.expected_layout,
        "put_errors": result.put_errors,
        "end": {"settle_s": result.end["settle_s"], "problems": result.end["problems"],
                "layout": {k: result.end["pools"].get(k) for k in ("prefill", "decode", "mixed", "status")}},
        "gateway_rss_mib": {"first": rss[0] if rss else None, "last": rss[-1] if rss else None,
                            "max": max(rss) if rss else None, "samples": len(rss),
                            "every_20th": [(round(t), round(mib)) for t, mib in result.rss_mib[::20]]},
        "server_counters": result.counters,
        "violations_by_invariant": dict(Counter(v["invariant"] for v in result.violations)),
        "violations": result.violations,
    }


def _md(summary: dict[str, Any]) -> str:
    req, rss = summary["requests"], summary["gateway_rss_mib"]
    lines = [f"# Chaos run: {summary['model']}, {summary['config']['duration_s']:g} s", "",
             f"**Invariant violations: {len(summary['violations'])}** "
             f"({', '.join(f'{k}: {n}' for k, n in summary['violations_by_invariant'].items()) or 'none'})",
             "", "## Requests", "", f"{req['total']} requests; by outcome: "
             + ", ".join(f"{k} {n}" for k, n in sorted(req["by_outcome"].items())), "",
             "By kind: " + "; ".join(f"{kind} " + ", ".join(f"{k} {n}" for k, n in sorted(outcomes.items()))
                                     for kind, outcomes in req["by_kind"].items()), ""]
    if req["errors_by_code"]:
        lines += ["Clear errors by code: " + ", ".join(f"`{k}` {n}" for k, n in sorted(
            req["errors_by_code"].items())), ""]
    lines += ["## Faults injected", "", "| fault:result | count |", "|---|---:|"]
    lines += [f"| {k} | {n} |" for k, n in sorted(summary["faults"].items())]
    if summary["injected_by_kind"]:
        lines += ["", "Injected, by kind: " + ", ".join(f"{k} {n}" for k, n in sorted(
            summary["injected_by_kind"].items()))]
    lines += _frontends_md(summary)
    lines += ["", "## What survives what", "", survival_md(summary["survival"])]
    mig = summary["migrations"]
    lines += ["", "## Moves", "", f"- failure migrations (pdserve:migrations_total): "
              f"{mig['pdserve:migrations_total']:g}",
              f"- stream moves the clients saw (timings.num_moves): {mig['stream_moves_seen_by_clients']}",
              f"- layout moves done by PUTs: {mig['layout_moves_done']}", "",
              "## End state", "", f"- expected layout {summary['expected_layout']}, reached "
              f"{summary['end']['layout']} after {summary['end']['settle_s']} s",
              f"- gateway RSS MiB first / last / max: {rss['first']:.0f} / {rss['last']:.0f} / "
              f"{rss['max']:.0f}"
              if rss["first"] is not None else "- gateway RSS: not sampled", ""]
    if summary["put_errors"]:
        lines += ["## PUTs that stopped part way", ""]
        lines += [f"- t={e['t_s']} s {e['body']}: {e['error']}" for e in summary["put_errors"]] + [""]
    lines += ["## Violations", "", "Each with the driver's actions before it (those not listed above).", ""]
    shown: set[str] = set()
    for v in summary["violations"]:
        context = {k: x for k, x in v.items() if k not in ("t_s", "invariant", "detail", "recent_actions",
                                                             "workers", "worker")}
        if isinstance(v.get("worker"), dict) and v["worker"].get("emptying"):  # why its drain has not ended
            context["emptying"] = v["worker"]["emptying"]
        lines.append(f"- t={v['t_s']} s **{v['invariant']}**: {v['detail']} {json.dumps(context)}")
        for action in v.get("recent_actions") or ():
            key = json.dumps(action, sort_keys=True, default=str)
            if key in shown:
                continue
            shown.add(key)
            lines.append(f"    - t={action['t_s']} s {action['kind']}: "
                         f"{json.dumps({k: x for k, x in action.items() if k not in ('t_s', 'kind')})[:300]}")
    return "\n".join(lines) + "\n"


def _frontends_md(summary: dict[str, Any]) -> list[str]:
    """The frontends, the fleet's kills and recoveries, and every worker that left (with its cause)."""
    fronts, lines = summary["frontends"], []
    if fronts["num"] > 1:
        lines += ["", f"## {fronts['num']} frontends", "",
                  "Requests a sample saw on each frontend (pid): " + (", ".join(
                      f"{pid} {n}" for pid, n in fronts["requests_seen_by_frontend"].items()) or "none"),
                  f"Requests cut by a frontend fault (their connection was on the frontend when it struck): "
                  f"{fronts['requests_cut']}", "", "| t (s) | fault | frontend pid | its connections | "
                  "requests cut |", "|---:|---|---:|---:|---:|"]
        lines += [f"| {f['t_s']} | {f['kind']} | {f['pid']} | {f['connections']} | {f['requests_cut']} |"
                  for f in fronts["faults"]]
    if summary["fleet_kills"]:
        lines += ["", "## Fleet actor kills", "",
                  "| t (s) | /health 503 after (s) | serving again after (s) |", "|---:|---:|---:|"]
        lines += [f"| {k['start_s']} | {k['to_503_s']} | {k['to_healthy_s']} |"
                  for k in summary["fleet_kills"]]
    if summary["supervisor_restarts"]:
        lines += ["", "## Supervisor restarts", "", "| t (s) | settings | /health ok after (s) | connections "
                  "cut | what it printed |", "|---:|---|---:|---:|---|"]
        lines += [f"| {r['start_s']} | {r['settings']} {' '.join(r['extra_args'])} | {r['to_healthy_s']} | "
                  f"{r['num_connections']} | {'; '.join(r['notes'])} |"
                  for r in summary["supervisor_restarts"]]
    if summary["worker_faults"]:
        lines += ["", "## Worker and transfer faults", "", "| t (s) | fault | workers | what happened |",
                  "|---:|---|---|---|"]
        for e in summary["worker_faults"]:
            workers = e.get("worker_ids") or [e.get("worker_id")]
            detail = {k: v for k, v in e.items() if k not in ("t_s", "kind", "worker_id", "worker_ids",
                                                              "start_s", "end_s", "pid", "answer")}
            lines.append(f"| {e.get('start_s', e['t_s'])} | {e['kind']} | {', '.join(map(str, workers))} | "
                         f"{json.dumps(detail)[:240]} |")
    for key, what in (("gateway_rss_by_process_mib", "Gateway"), ("worker_rss_mib", "Worker")):
        rows = summary.get(key) or []
        if rows:
            grew = max((w["last_mib"] - w["first_mib"] for w in rows), default=0)
            longest = sorted(rows, key=lambda w: w["from_s"] - w["to_s"])[:3]
            lines += ["", f"{what} RSS (each process, from {WARMUP_S:g} s after it was first seen): largest "
                      f"growth {grew} MiB over {len(rows)} processes; the longest-lived: "
                      + ", ".join(f"{w['worker_id']} {w['first_mib']} → {w['last_mib']} MiB ({w['from_s']}-"
                                  f"{w['to_s']} s)" for w in longest)]
    if summary["departures"]:
        lines += ["", "## Workers that left", "", "| gone at t (s) | worker | role | pid | cause |",
                  "|---:|---|---|---:|---|"]
        lines += [f"| {d['gone_s']} | {d['worker_id']} | {d['role']} | {d['pid']} | "
                  f"{d['cause'] or '**none: a violation**'} |" for d in summary["departures"]]
    return lines


def write_report(result: ChaosResult, out_dir: Path) -> tuple[dict[str, Any], str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(result)
    text = _md(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out_dir / "summary.md").write_text(text)
    (out_dir / "requests.jsonl").write_text("".join(record_row(r) + "\n" for r in result.records))
    events = "".join(json.dumps(e, default=str) + "\n" for e in result.log.events)
    (out_dir / "events.jsonl").write_text(events)
    return summary, text
