"""Watching the running system: /health, /admin/pools, the RSS of every process, /metrics, the KV settle.

SoakMonitor keeps what was seen: a sample every --sample-every s (phase "warmup" → "soak" → "drain", plus
one "baseline" after the warm-up and one "end"), every /health answer with its time (the kill timer's polls
included), and why a sample could not be taken. Each process is labelled and grouped (gateway, prefill,
decode, ray_system, ray_idle, other) so RSS growth can be pinned on one.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.reliability.soaklib.cluster import SoakSystem, worker_pids
from tests.reliability.soaklib.config import SoakConfig


def label_process(process: psutil.Process, roots: dict[int, str], actors: dict[int, str]) -> tuple[str, str]:
    """(label, group) of one process: groups are gateway, prefill, decode, ray_system, ray_idle, other."""
    if process.pid in roots:
        return roots[process.pid], "gateway" if roots[process.pid] == "gateway" else "ray_system"
    if process.pid in actors:
        worker_id = actors[process.pid]
        return worker_id, worker_id.split("-")[0]
    try:
        name = process.name()
        cmdline = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        name = cmdline = ""
    if name in ("gcs_server", "raylet"):
        return f"ray:{name}", "ray_system"
    for needle, label in (("log_monitor.py", "log_monitor"),
                          ("autoscaler/_private/monitor.py", "autoscaler"),
                          ("runtime_env/agent", "runtime_env_agent"),
                          ("dashboard/agent.py", "dashboard_agent"),
                          ("dashboard/dashboard.py", "dashboard_head")):  # runs without the dashboard too
        if needle in cmdline:
            return f"ray:{label}", "ray_system"
    if cmdline.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")):
        return f"ray:{cmdline.split()[0].removeprefix('ray::')}", "ray_system"
    if cmdline.startswith("ray::"):  # an idle pooled worker, or an actor not yet in the table
        return f"ray-worker:{cmdline.split()[0]}:{process.pid}", "ray_idle"
    return f"other:{cmdline[:80]}:{process.pid}", "other"


def rss_snapshot(system: SoakSystem, actors: dict[int, str]) -> list[dict[str, Any]]:
    roots = {p.pid: label for p, label in ((system.server, "gateway"), (system.ray_head, "ray:ray_start"))
             if p is not None}
    rows = []
    for process in system.processes():
        try:
            rss = process.memory_info().rss
            label, group = label_process(process, roots, actors)
        except psutil.NoSuchProcess:
            continue
        rows.append({"label": label, "group": group, "pid": process.pid, "rss_mib": rss / 2**20})
    return rows


@dataclass
class SoakMonitor:
    """What the soak saw of the system, and how it looks: each call records its answer here."""

    config: SoakConfig
    system: SoakSystem
    client: httpx.AsyncClient
    start: float = 0.0  # perf_counter when traffic started
    samples: list[dict[str, Any]] = field(default_factory=list)
    health_log: list[tuple[float, str]] = field(default_factory=list)  # every /health answer: (t_s, status)
    in_flight: list[int] = field(default_factory=lambda: [0])  # a mutable count shared with the senders
    actors: dict[int, str] = field(default_factory=dict)  # pid → worker id, every worker seen so far
    samples_missed: list[str] = field(default_factory=list)  # why a sample could not be taken

    def now(self) -> float:
        return time.perf_counter() - self.start

    async def health(self) -> str:
        try:
            response = await self.client.get("/health", timeout=30)
            status = str(response.json().get("status", f"http_{response.status_code}"))
        except (httpx.HTTPError, ValueError) as error:
            status = f"unreachable:{type(error).__name__}"
        self.health_log.append((self.now(), status))
        return status

    async def pools(self) -> list[dict[str, Any]]:
        try:
            response = await self.client.get("/admin/pools", timeout=30)
            return list(response.json()["workers"])
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    async def refresh_actors(self) -> dict[str, int]:
        alive, every = await asyncio.to_thread(worker_pids)
        self.actors.update(every)
        return alive

    async def take_sample(self, phase: str) -> dict[str, Any]:
        await self.refresh_actors()
        sample = {"t_s": self.now(), "phase": phase, "health": await self.health(),
                  "workers": await self.pools(), "num_in_flight": self.in_flight[0],
                  "processes": rss_snapshot(self.system, self.actors)}
        self.samples.append(sample)
        return sample

    async def sample_forever(self, phase: list[str]) -> None:
        while True:
            try:
                await self.take_sample(phase[0])
            except Exception as error:  # a missed sample must not end the sampling (nor the soak)
                self.samples_missed.append(f"{self.now():.1f} s: {type(error).__name__}: {error}")
            await asyncio.sleep(self.config.sample_every_s)

    async def settle(self) -> dict[str, Any]:
        """Wait up to settle_s for every worker to hold no KV block, nothing running, waiting or moving."""
        began = self.now()
        while True:
            workers = [w for w in await self.pools() if "used_kv_blocks" in w]
            busy = [w for w in workers if w["used_kv_blocks"] or w["running_requests"]
                    or w["waiting_requests"] or w["transferring"]]
            if (workers and not busy) or self.now() - began > self.config.settle_s:
                return {"waited_s": self.now() - began, "is_whole": bool(workers) and not busy,
                        "workers": workers}
            await asyncio.sleep(1)


def server_counters(text: str) -> dict[str, float]:
    """The gateway's own tallies from /metrics: requests by outcome, errors by code, migrations."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("pdserve:request_success_total", "pdserve:request_errors_total", "pdserve:migrations_total")
    return {f"{s.name}{{{','.join(f'{k}={v}' for k, v in s.labels.items() if k != 'model_name')}}}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name in wanted}
