"""The report of one soak run: the files it writes under --out, and the summary it prints.

Input: SoakResult, what the run saw. Output: requests.jsonl, samples.jsonl, health.jsonl, summary.json,
summary.md and soak.png (when matplotlib is there); server.log and ray_head.log are written by the
processes themselves. Results are files, never asserts.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadgen.summary import percentiles
from tests.reliability.soaklib.config import SoakConfig
from tests.reliability.soaklib.traffic import SoakRecord


@dataclass(frozen=True)
class SoakResult:
    """What one run saw, from the first request to the end sample."""

    model: str  # the served model's id (/v1/models)
    model_dir: str
    records: list[SoakRecord]  # one per request, warm-up included, in arrival order
    samples: list[dict[str, Any]]  # SoakMonitor.take_sample rows, in time order
    health_log: list[tuple[float, str]]  # every /health answer: (t_s, status)
    kills: list[dict[str, Any]]  # WorkerKiller rows
    baseline: dict[str, Any]  # the sample right after the warm-up
    end: dict[str, Any]  # the sample after the settle
    kv_end: dict[str, Any]  # SoakMonitor.settle: waited_s, is_whole, workers
    server_counters: dict[str, float]  # the gateway's /metrics tallies at the end; empty if unreachable
    samples_missed: list[str]  # why a sample could not be taken


def rss_report(baseline: dict[str, Any], end: dict[str, Any]) -> dict[str, Any]:
    before = {p["pid"]: p for p in baseline["processes"]}
    after = {p["pid"]: p for p in end["processes"]}
    both = [{"label": after[pid]["label"], "pid": pid, "start_mib": before[pid]["rss_mib"],
             "end_mib": after[pid]["rss_mib"], "growth_mib": after[pid]["rss_mib"] - before[pid]["rss_mib"]}
            for pid in before if pid in after]
    groups: dict[str, dict[str, float]] = {}
    for name, rows in (("start_mib", before.values()), ("end_mib", after.values())):
        for p in rows:
            groups.setdefault(p["group"], {"start_mib": 0.0, "end_mib": 0.0})[name] += p["rss_mib"]
    for totals in groups.values():
        totals["growth_mib"] = totals["end_mib"] - totals["start_mib"]
    return {"baseline_t_s": baseline["t_s"], "end_t_s": end["t_s"],
            "processes": sorted(both, key=lambda p: -p["growth_mib"]),
            "new_since_baseline": [{"label": p["label"], "pid": p["pid"], "end_mib": p["rss_mib"]}
                                   for pid, p in after.items() if pid not in before],
            "gone_since_baseline": [{"label": p["label"], "pid": p["pid"], "start_mib": p["rss_mib"]}
                                    for pid, p in before.items() if pid not in after],
            "groups": groups}


def server_log_report(path: Path, records: list[SoakRecord]) -> dict[str, Any]:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    bad = [line for line in lines if any(k in line for k in ("ERROR", "Error", "Traceback", "WARNING"))]
    wanted = {r.request_id for r in records if r.request_id and r.outcome in ("error", "hung")}
    mentions = {rid: [line for line in lines if rid in line][:3] for rid in sorted(wanted)}
    return {"num_lines": len(lines), "num_error_or_warning_lines": len(bad), "examples": bad[:40],
            "lines_naming_failed_requests": {k: v for k, v in mentions.items() if v}}


def summarize(config: SoakConfig, result: SoakResult) -> dict[str, Any]:
    records = result.records
    soak = [r for r in records if r.phase == "soak"]
    outcomes = Counter(r.outcome for r in soak)
    ok = [r for r in soak if r.outcome == "ok"]
    # With ignore_eos a request that finished "length" must have sent exactly max_tokens, each once.
    mismatches = [{"index": r.index, "request_id": r.request_id, "max_tokens": r.output_len,
                   "received": r.num_output_tokens, "usage": r.usage_completion_tokens,
                   "finish_reason": r.finish_reason}
                  for r in ok if r.usage_completion_tokens not in (None, r.num_output_tokens)
                  or (r.finish_reason == "length" and r.num_output_tokens != r.output_len)]
    variants = Counter(f"{r.endpoint}/{'stream' if r.is_stream else 'whole'}/{r.cancel}" for r in soak)
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "model": result.model, "model_dir": result.model_dir,
        "requests": {"sent": len(soak), "ok": outcomes["ok"], "cancelled_by_client": outcomes["cancelled"],
                     "errors": outcomes["error"], "hung": outcomes["hung"],
                     "errors_by_kind": dict(Counter(r.error_kind for r in soak if r.outcome == "error")),
                     "by_variant": dict(sorted(variants.items())),
                     "warmup": dict(Counter(r.outcome for r in records if r.phase == "warmup"))},
        "hung": [{"index": r.index, "request_id": r.request_id, "sent_s": r.sent_s,
                  "tokens": r.num_output_tokens} for r in records if r.outcome == "hung"],
        "errors": [{"index": r.index, "request_id": r.request_id, "kind": r.error_kind, "sent_s": r.sent_s,
                    "ended_s": r.ended_s, "message": r.error} for r in records if r.outcome == "error"],
        "token_count_mismatches": mismatches,
        "latency_ok_s": {
            "ttft": percentiles([r.ttft_s for r in ok if r.ttft_s is not None]),
            "e2e": percentiles([r.e2e_s for r in ok if r.e2e_s is not None]),
        },
        "kills": result.kills,
        "server_counters": result.server_counters,
        "samples_missed": result.samples_missed,
        "kv_end": result.kv_end,
        "rss": rss_report(result.baseline, result.end),
        "health_samples": dict(Counter(s["health"] for s in result.samples)),
        "health_answers": dict(Counter(h for _, h in result.health_log)),
        "server_log": server_log_report(config.out_dir / "server.log", records),
    }


def markdown(summary: dict[str, Any]) -> str:
    req, kv, rss = summary["requests"], summary["kv_end"], summary["rss"]
    config = summary["config"]
    lines = [f"# Soak: {config['duration_s']:.0f} s, {config['num_prefill']}P+{config['num_decode']}D, "
             f"{config['rate']} req/s, kill every {config['kill_every_s']:.0f} s"
             f"{' (busy workers)' if config.get('kill_busy') else ''}",
             "", f"Model `{summary['model']}`. Command: `.venv/bin/python benchmarks/soak.py "
             f"--duration {config['duration_s']:.0f} --kill-every {config['kill_every_s']:.0f} "
             f"--rate {config['rate']} --cancel-fraction {config['cancel_fraction']} "
             f"--warmup {config['warmup_s']:.0f}{' --kill-busy' if config.get('kill_busy') else ''}`", "",
             "| requests | count |", "|---|---:|"]
    lines += [f"| {k.replace('_', ' ')} | {req[k]} |" for k in ("sent", "ok", "cancelled_by_client", "errors",
                                                                  "hung")]
    lines += [f"| error: `{kind}` | {n} |" for kind, n in sorted(req["errors_by_kind"].items())]
    lines += [f"| token count mismatches | {len(summary['token_count_mismatches'])} |", "",
              f"| kill at s (soak from {config['warmup_s']:.0f} s) | worker | its running / waiting | "
              "health left ok after s | ok again after s | replaced by |", "|---:|---|---:|---:|---:|---|"]
    for k in summary["kills"]:
        left_ok, ok_again = k.get("detected_after_s", float("nan")), k.get("ok_again_after_s", float("nan"))
        lines.append(f"| {k['t_s']:.0f} | {k.get('worker_id', '-')} | {k.get('victim_running')} / "
                     f"{k.get('victim_waiting')} | {left_ok:.2f} | {ok_again:.1f} | "
                     f"{k.get('replaced_by', k.get('error'))} |")
    whole = "whole" if kv["is_whole"] else "NOT whole"
    lines += ["", f"KV at the end ({whole} after {kv['waited_s']:.1f} s): "
              + ", ".join(f"{w['worker_id']} {w['used_kv_blocks']} used" for w in kv["workers"]), "",
              f"| RSS MiB (t {rss['baseline_t_s']:.0f} s → {rss['end_t_s']:.0f} s) | start | end | growth |",
              "|---|---:|---:|---:|"]
    lines += [f"| {p['label']} (pid {p['pid']}) | {p['start_mib']:.0f} | {p['end_mib']:.0f} | "
              f"{p['growth_mib']:+.1f} |" for p in rss["processes"]]
    lines += [f"| new: {p['label']} (pid {p['pid']}) | - | {p['end_mib']:.0f} | - |"
              for p in rss["new_since_baseline"]]
    lines += [f"| group {g} | {t['start_mib']:.0f} | {t['end_mib']:.0f} | {t['growth_mib']:+.1f} |"
              for g, t in sorted(rss["groups"].items())]
    counters = ", ".join(f"`{k}` {v:.0f}" for k, v in summary["server_counters"].items())
    lines += ["", "Group rows sum a group's processes at each time (a replacement stands in for the one it "
              "replaced).", "", f"Gateway counters at the end (warm-up included): {counters}."]
    lines += ["", f"/health answers (samples, polls after kills): {summary['health_answers']}. Server log: "
              f"{summary['server_log']['num_error_or_warning_lines']} error/warning lines (server.log)."]
    return "\n".join(lines) + "\n"


def plot(samples: list[dict[str, Any]], health_log: list[tuple[float, str]], kills: list[dict[str, Any]],
         path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    times = [s["t_s"] for s in samples]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for group in sorted({p["group"] for s in samples for p in s["processes"]}):
        top.plot(times, [sum(p["rss_mib"] for p in s["processes"] if p["group"] == group) for s in samples],
                 label=group)
    top.plot(times, [sum(p["rss_mib"] for p in s["processes"]) for s in samples], "k--", label="all")
    top.set(ylabel="RSS MiB (sum per group)")
    top.legend(fontsize=7, ncol=4)
    levels = {"ok": 2, "degraded": 1, "unavailable": 0}
    middle.step([t for t, _ in health_log], [levels.get(h, -1) for _, h in health_log], where="post")
    middle.set(yticks=[-1, 0, 1, 2], yticklabels=["unreachable", "unavailable", "degraded", "ok"])
    workers = sorted({w["worker_id"] for s in samples for w in s["workers"]})
    for worker in workers:
        used = [next((w.get("used_kv_blocks") for w in s["workers"] if w["worker_id"] == worker), None)
                for s in samples]
        bottom.plot(times, [float("nan") if u is None else u for u in used], label=worker)
    bottom.plot(times, [s["num_in_flight"] for s in samples], "k:", label="client in flight")
    bottom.set(xlabel="s since traffic started", ylabel="used KV blocks")
    bottom.legend(fontsize=7, ncol=4)
    soak_start = next((s["t_s"] for s in samples if s["phase"] == "baseline"), None)
    for axis in (top, middle, bottom):
        for k in kills:
            axis.axvline(k["t_s"], color="red", alpha=0.4)  # a kill
        if soak_start is not None:
            axis.axvline(soak_start, color="gray", linestyle="--", alpha=0.6)  # warm-up ends, baseline
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def write_report(config: SoakConfig, result: SoakResult) -> tuple[dict[str, Any], str]:
    """Writes every report file under config.out_dir.

    Returns:
        The summary (as in summary.json) and the text to print: summary.md's, plus a line for the plot.
    """
    summary = summarize(config, result)
    out = config.out_dir
    (out / "requests.jsonl").write_text("".join(r.to_json() + "\n" for r in result.records))
    (out / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in result.samples))
    (out / "health.jsonl").write_text("".join(json.dumps({"t_s": t, "status": h}) + "\n"
                                              for t, h in result.health_log))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    if plot(result.samples, result.health_log, result.kills, out / "soak.png"):
        text += "\nPlot: soak.png\n"
    return summary, text
