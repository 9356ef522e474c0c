"""Worker kills: SIGKILL one random active worker every --kill-every s of the soak, and time its replacement.

One kill, in order (the fields of its row in summary.json):
  1. waits until /health is "ok" again (deferred_s), so kills never stack on an unfinished replacement;
  2. draws a kind (prefill or decode), then an active worker of it, and finds its actor's pid;
  3. sends SIGKILL, only to a pid under this soak's own Ray head (the machine is shared);
  4. polls /health and /admin/pools every 0.25 s: detected_after_s when /health first leaves "ok",
     ok_again_after_s and replaced_by once it is "ok" with the victim gone and a new worker of its kind
     active; "error" when not within 600 s.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from dataclasses import dataclass, field
from typing import Any

from tests.reliability.soaklib.sampling import SoakMonitor


@dataclass
class WorkerKiller:
    monitor: SoakMonitor  # the kills' /health polls go to its health_log
    kills: list[dict[str, Any]] = field(default_factory=list)  # one row per kill, in summary.json

    async def kill_forever(self, rng: random.Random) -> None:
        """Every kill_every_s of the soak phase: SIGKILL one active worker, time its replacement.

        The kind (prefill or decode) is drawn first, then a worker of it, so both failure paths (prefill
        retry, decode migration) get exercised whatever the pool sizes.
        """
        monitor, config = self.monitor, self.monitor.config
        number = 1
        while number * config.kill_every_s < config.duration_s:
            kill_at = config.warmup_s + number * config.kill_every_s
            await asyncio.sleep(max(0.0, kill_at - monitor.now()))
            number += 1
            waited = monitor.now()
            while await monitor.health() != "ok" and monitor.now() - waited < config.kill_every_s:
                await asyncio.sleep(1)  # the previous replacement is not done: do not stack kills
            before = await monitor.pools()
            candidates = self._candidates(before)
            while config.kill_busy and not candidates and monitor.now() - waited < config.kill_every_s:
                await asyncio.sleep(0.2)  # a busy worker: one with requests running right now
                before = await monitor.pools()
                candidates = self._candidates(before)
            if not candidates:
                self.kills.append({"t_s": monitor.now(), "error": "no active worker to kill",
                                   "workers": before})
                continue
            kind = rng.choice(sorted({w["role"] for w in candidates}))
            victim = rng.choice([w for w in candidates if w["role"] == kind])
            pid = (await monitor.refresh_actors()).get(victim["worker_id"])
            kill = {"t_s": monitor.now(), "worker_id": victim["worker_id"], "kind": victim["role"],
                    "pid": pid, "deferred_s": monitor.now() - waited,
                    "client_in_flight": monitor.in_flight[0],
                    "victim_running": victim.get("running_requests"),
                    "victim_waiting": victim.get("waiting_requests")}
            if pid is None or pid not in {p.pid for p in monitor.system.processes()}:
                # Only ever signal a process of this soak's own Ray head (the machine is shared).
                kill["error"] = "its actor's pid is not a live process under this soak's Ray head"
                self.kills.append(kill)
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                kill["error"] = "its process was already gone"
            self.kills.append(kill)
            await self.time_replacement(kill, {w["worker_id"] for w in before})

    def _candidates(self, workers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [w for w in workers if w.get("state") == "active" and w["role"] in ("prefill", "decode")
                and (not self.monitor.config.kill_busy or (w.get("running_requests") or 0) > 0)]

    async def time_replacement(self, kill: dict[str, Any], ids_before: set[str]) -> None:
        """Poll until /health is "ok" with the killed worker gone and a new one of its kind active."""
        monitor = self.monitor
        statuses: list[str] = []
        while monitor.now() - kill["t_s"] < 600:
            status = await monitor.health()
            if status != "ok" and "detected_after_s" not in kill:
                kill["detected_after_s"] = monitor.now() - kill["t_s"]
            if not statuses or statuses[-1] != status:
                statuses.append(status)
            workers = await monitor.pools()
            ids = {w["worker_id"] for w in workers}
            new = [w["worker_id"] for w in workers if w["worker_id"] not in ids_before
                   and w["role"] == kill["kind"] and w.get("state") == "active"]
            if status == "ok" and kill["worker_id"] not in ids and new:
                kill["replaced_by"] = new[0]
                kill["ok_again_after_s"] = monitor.now() - kill["t_s"]
                break
            await asyncio.sleep(0.25)
        else:
            kill["error"] = "not replaced within 600 s"
        kill["health_seen"] = statuses
