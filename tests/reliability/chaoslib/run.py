"""run_chaos(): the whole run against a server that is already up (benchmarks/chaos.py, the slow test).

  1. the greedy reference (transformers, float32) and the request mix;
  2. for duration_s: every request on its own client, the FaultDriver's faults, the PoolWatch's looks
     (with several frontends: each request on a fresh connection, and the FrontendMap's samples of which
     frontend holds which);
  3. the driver's PUTs answer, auto goes off and the starting layout is set again (the last accepted
     target); every request ends (each within its deadline + hang_grace_s), the loop bursts' too;
  4. end checks, for up to settle_s: the layout is the last accepted target, every worker active, /health
     "ok", no change in progress, 0 KV blocks used and nothing running, waiting or moving on any worker;
     every worker that left was drained or killed by a fault that may kill one (departures.py); with
     several frontends, more than one served requests;
  5. the gateway's counters (/metrics) → ChaosResult.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.reliability.chaoslib.burst import LoopBurst
from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.connections import chaos_client
from tests.reliability.chaoslib.departures import check_departures
from tests.reliability.chaoslib.driver import ROLES, FaultDriver, drawable
from tests.reliability.chaoslib.fleet_faults import FleetFaults
from tests.reliability.chaoslib.frontends import FrontendCut, FrontendMap
from tests.reliability.chaoslib.log import ChaosLog
from tests.reliability.chaoslib.reference import greedy_prompts, greedy_reference
from tests.reliability.chaoslib.supervisor import SupervisorRestarts
from tests.reliability.chaoslib.tenants import SaltedTenants
from tests.reliability.chaoslib.traffic import ChaosRecord, build_specs, send
from tests.reliability.chaoslib.watch import PoolWatch
from tests.reliability.chaoslib.worker_faults import WorkerFaults


@dataclass
class ChaosResult:
    config: ChaosConfig
    model: str
    records: list[ChaosRecord]
    log: ChaosLog  # events and violations
    faults: dict[str, int]
    put_errors: list[dict[str, Any]]  # PUTs answered 200 with an error: the plan stopped part way
    expected_layout: dict[str, int] | None  # the last accepted target
    end: dict[str, Any]  # the end checks: what /admin/pools showed, how long the settle took
    rss_mib: list[tuple[float, float]]  # the gateway's (t_s, RSS)
    counters: dict[str, float] = field(default_factory=dict)  # /metrics at the end
    injected: dict[str, int] = field(default_factory=dict)  # faults by kind, those not skipped
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # each kill_fleet: to 503, to healthy
    departures: list[dict[str, Any]] = field(default_factory=list)  # workers gone, each with its cause
    cuts: list[FrontendCut] = field(default_factory=list)  # the frontend faults and connections they held
    requests_by_frontend: dict[int, int] = field(default_factory=dict)  # pid → requests a sample saw on it
    worker_rss: list[dict[str, Any]] = field(default_factory=list)  # each worker process: RSS after warm-up
    restarts: list[dict[str, Any]] = field(default_factory=list)  # each restart_supervisor
    gateway_rss: list[dict[str, Any]] = field(default_factory=list)  # each gateway process: RSS after warm-up

    @property
    def violations(self) -> list[dict[str, Any]]:
        return self.log.violations

    @property
    def num_busy_kills(self) -> int:
        return sum(n for kind, n in self.faults.items()
                   if kind.startswith("kill_busy:") and "skipped" not in kind)

    @property
    def num_migrations(self) -> int:
        """Streams moved off a decode worker: on failures (pdserve:migrations_total), or as the clients saw
        them (timings.num_moves: failures, role changes and drains)."""
        return max(int(self.counters.get("pdserve:migrations_total", 0)),
                   sum(r.num_moves or 0 for r in self.records))

    @property
    def layout_moves(self) -> list[str]:
        """What the PUTs' answers say was done: workers added, drained, changed role."""
        return [done for e in self.log.events if e["kind"] == "put" for done in e.get("done") or ()]


def _layout(pools: dict[str, Any]) -> dict[str, int]:
    return {role: int(pools.get(role, 0)) for role in ROLES}


async def end_checks(config: ChaosConfig, watch: PoolWatch, log: ChaosLog,
                     expected: dict[str, int] | None) -> dict[str, Any]:
    started = log.now()
    problems: dict[str, str] = {}
    pools: dict[str, Any] = {}
    while True:
        problems = {}
        try:
            pools = await watch.fetch_pools()
            health = (await watch.client.get("/health", timeout=15)).json().get("status")
        except (httpx.HTTPError, ValueError) as error:
            problems["admin_answers"] = f"/admin/pools or /health: {type(error).__name__}: {error}"
        else:
            workers = pools.get("workers", [])
            if expected is not None and _layout(pools) != expected:
                problems["layout_reached"] = (f"active layout {_layout(pools)}, target "
                                              f"{pools.get('target')}, last accepted {expected}")
            if [w for w in workers if w["state"] != "active"]:
                problems["worker_back_to_active"] = "; ".join(
                    f"{w['worker_id']} {w['role']} {w['state']} (next {w.get('next_role')}; holds "
                    f"{w.get('requests')} requests; emptying: {w.get('emptying') or '-'})"
                    for w in workers if w["state"] != "active")
            if health != "ok":
                problems["health_ok"] = f"/health says {health!r}"
            if pools.get("change_in_progress"):
                problems["no_change_stuck"] = f"change in progress: {pools['change_in_progress']}"
            held = [w for w in workers if w.get("used_kv_blocks") or w.get("running_requests")
                    or w.get("waiting_requests") or w.get("transferring")]
            if held:
                problems["kv_freed"] = "; ".join(
                    f"{w['worker_id']} used_kv_blocks={w.get('used_kv_blocks')} running="
                    f"{w.get('running_requests')} waiting={w.get('waiting_requests')} transferring="
                    f"{w.get('transferring')}" for w in held)
            # The gateway's books: a booking left behind holds every later drain of that worker.
            booked = {w["worker_id"]: w["tokens_on_the_way"] for w in workers if w.get("tokens_on_the_way")}
            if booked:
                problems["books_freed"] = f"tokens still booked on their way to {booked}"
        if not problems or log.now() - started > config.settle_s:
            break
        await asyncio.sleep(1.0)
    for invariant, detail in problems.items():
        log.violate(invariant, f"after {log.now() - started:.0f} s of settling: {detail}",
                    pools_status=pools.get("status"), auto=pools.get("auto"), target=pools.get("target"),
                    workers=pools.get("workers"), recent_actions=log.recent(120.0))
    return {"settle_s": round(log.now() - started, 2), "pools": pools, "problems": problems}


def server_counters(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("pdserve:request_success_total", "pdserve:request_errors_total", "pdserve:migrations_total")
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                labels = ",".join(f"{k}={v}" for k, v in sample.labels.items() if k != "model_name")
                counters[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return counters


def requests_by_frontend(records: list[ChaosRecord], frontends: FrontendMap) -> dict[int, int]:
    """Each record's frontend (where a sample saw its connection), counted by pid."""
    counts: dict[int, int] = {}
    for record in records:
        record.frontend_pid = frontends.frontend_of(record.client_port, record.sent_s, record.ended_s)
        if record.frontend_pid is not None:
            counts[record.frontend_pid] = counts.get(record.frontend_pid, 0) + 1
    return counts


WARMUP_S = 60.0  # a process's RSS counts from this long after it was first seen (its compile, caches)


def process_rss(samples_by_process: dict[tuple[str, int], list[tuple[float, float]]], invariant: str,
                config: ChaosConfig, log: ChaosLog) -> list[dict[str, Any]]:
    """Each process's RSS from WARMUP_S after it was first seen to its last sample; growth past the limit
    over a life of 5 minutes or more is a violation (a short life shows no trend). A process is keyed by
    (its worker id or gateway part, its pid): a restart is a new process, counted from anew."""
    rows = []
    for (name, pid), samples in sorted(samples_by_process.items(), key=lambda item: item[1][0][0]):
        warm = [(t, mib) for t, mib in samples if t >= samples[0][0] + WARMUP_S]
        if len(warm) < 2:
            continue
        (t0, first), (t1, last) = warm[0], warm[-1]
        row = {"worker_id": name, "pid": pid, "from_s": round(t0), "to_s": round(t1),
               "first_mib": round(first), "last_mib": round(last), "max_mib": round(max(m for _, m in warm)),
               # Its curve (every 10th sample from its first): a ramp that levels off is no leak.
               "curve": [(round(t), round(mib)) for t, mib in samples[::10]]}
        rows.append(row)
        if (config.rss_growth_limit_mib is not None and t1 - t0 >= 300.0
                and last - first > config.rss_growth_limit_mib):
            log.violate(invariant, f"{name} (pid {pid}) RSS {first:.0f} → {last:.0f} MiB over "
                        f"{t1 - t0:.0f} s (> {config.rss_growth_limit_mib:g} MiB growth)", **row)
    return rows


def check_innocents(records: list[ChaosRecord], windows: list[tuple[float, float, int]],
                    log: ChaosLog) -> None:
    """No request but the query of death fails for it: a `worker_failed` error ending inside a query of
    death's window is an innocent one it took down (they must move to another worker instead)."""
    for record in records:
        if "worker_failed" not in record.error_code:
            continue
        for started, ended, seed in windows:
            if started <= record.ended_s <= ended + 5.0:
                log.violate("innocent_survives", f"request {record.index} ({record.kind}) failed with "
                            f"{record.error_code} during the query of death of seed {seed}: "
                            f"{record.error_message[:200]}", request=record.index)


async def run_chaos(config: ChaosConfig, target: ChaosTarget) -> ChaosResult:
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    async with chaos_client(target.url, headers, config.has_frontends) as client:
        listed = (await client.get("/v1/models", timeout=30)).json()["data"][0]
        model, max_model_len = listed["id"], int(listed.get("max_model_len") or 2048)
        vocab_size = int(json.loads((target.model_dir / "config.json").read_text())["vocab_size"])
        rng = random.Random(config.seed)
        prompts = greedy_prompts(rng, vocab_size, config.num_greedy_prompts, config.long_fraction,
                                 max_model_len - config.max_greedy_tokens - 8)
        pool = await asyncio.to_thread(greedy_reference, target.model_dir, prompts, config.max_greedy_tokens)
        specs = build_specs(config, pool, vocab_size, max_model_len)
        log = ChaosLog()
        watch = PoolWatch(config, target, client, log)
        initial = _layout(await watch.fetch_pools())
        frontends = FrontendMap(config, target, log, random.Random(config.seed + 2)) if (
            config.has_frontends) else None
        burst = LoopBurst(config, client, log, frontends, model, random.Random(config.seed + 3))
        workers = WorkerFaults(config, target, client, log, watch, model, random.Random(config.seed + 4))
        if config.has_frontends:  # the worker faults reach the actors through Ray (before any traffic)
            workers.connect()
        driver = FaultDriver(config, target, client, log, watch, random.Random(config.seed + 1), frontends,
                             FleetFaults(config, target, client, log, watch), burst,
                             workers,
                             SupervisorRestarts(config, target, log, watch, frontends) if frontends else None,
                             SaltedTenants(client, log, model, random.Random(config.seed + 5)))
        log.event("start", layout=initial, num_requests=len(specs), frontends=target.frontend_pids())
        watching = [asyncio.create_task(watch.watch_forever())]
        if frontends is not None:
            watching.append(asyncio.create_task(frontends.watch_forever()))
        in_flight = [0]
        sending = [asyncio.create_task(send(client, s, model, log.start, config, in_flight, frontends))
                   for s in specs]
        try:
            await driver.drive(until_s=config.duration_s)
        except Exception as error:  # report what the run saw rather than lose it
            log.event("driver_failed", error=f"{type(error).__name__}: {error}")
        log.event("faults_end", in_flight=in_flight[0])
        try:
            await driver.finish(initial)
        except (httpx.HTTPError, ValueError) as error:  # the server is gone: the end checks say so
            log.event("finish_failed", error=f"{type(error).__name__}: {error}")
        records = list(await asyncio.gather(*sending)) + await burst.records()
        log.event("traffic_end")
        end = await end_checks(config, watch, log, driver.last_accepted)
        for task in watching:
            task.cancel()
        watch.sample_rss()
        try:
            counters = server_counters((await client.get("/metrics", timeout=30)).text)
        except httpx.HTTPError:
            counters = {}
    for record in records:
        for why in record.violations:
            log.violate("request_ends_clean", why, request=record.index, kind=record.kind,
                        stream=record.is_stream, behaviour=record.behaviour, sent_s=round(record.sent_s, 2),
                        ended_s=round(record.ended_s, 2), error_code=record.error_code)
    check_innocents(records, driver.workers.windows, log)
    departures = check_departures(watch.ledger, log, config)
    by_frontend: dict[int, int] = {}
    if frontends is not None:
        by_frontend = requests_by_frontend(records, frontends)
        if len(by_frontend) < 2:
            log.violate("traffic_spread", f"requests were seen on {len(by_frontend)} frontend(s) in "
                        f"{frontends.num_samples} samples: {by_frontend}")
    rss_by_gateway_process = process_rss(watch.gateway_rss_by_process, "gateway_rss_flat", config, log)
    rss_by_worker = process_rss(watch.worker_rss_mib, "worker_rss_flat", config, log)
    # A fault kind that was drawn but never struck (its every try skipped: a harness that cannot reach the
    # workers) proves nothing: the run falls short of what it claims to cover.
    short = {kind: driver.injected[kind] for kind in drawable(config)
             if driver.injected[kind] < config.min_each_fault}
    if short:
        log.violate("every_fault_injected", f"fault kinds injected fewer than {config.min_each_fault} times: "
                    f"{short}; skips: { {k: n for k, n in driver.faults.items() if 'skipped' in k} }")
    return ChaosResult(config, model, records, log, dict(driver.faults), driver.put_errors,
                       driver.last_accepted, end, watch.rss_mib, counters, dict(driver.injected),
                       driver.fleet.recoveries, departures, frontends.cuts if frontends else [], by_frontend,
                       rss_by_worker, driver.supervisor.restarts if driver.supervisor else [],
                       rss_by_gateway_process)
