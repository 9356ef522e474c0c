"""The frontends of `--api-server-count N`: which one holds which client connection, and their faults.

FrontendMap samples, every second, the connections each frontend process holds on the server's port (the
client's port of each: chaoslib/connections.py records every request's), so that the report can
say that both frontends served, and which. Its faults, both on a frontend drawn at random:
  kill_frontend   SIGSTOP (it accepts nothing more), note the client ports of its connections, SIGKILL;
                  uvicorn's supervisor starts another
  pause_frontend  SIGSTOP, note its connections, sleep 4, 6, 12 or 15 s (in turn), SIGCONT (uvicorn's
                  supervisor pings its children every 0.5 s and kills one silent for
                  gateway.frontends.FRONTEND_UNANSWERED_S, 30 s: a 12 s pause is given up by the fleet's lease
                  (10 s), not killed, and must resume serving; so is a 15 s one)
A request whose connection was one of those noted and that ended in a connection error is "cut by a
frontend fault" (FrontendMap.cut_of): allowed; so is any request open during a supervisor restart
(tests/reliability/chaoslib/supervisor.py), which stops every frontend. A connection error on any other
connection stays a violation.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import psutil

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.log import ChaosLog

PAUSES_S = (4.0, 6.0, 12.0, 15.0)


@dataclass(frozen=True)
class FrontendCut:
    """A frontend fault, and the connections the frontend held when it struck."""

    kind: str  # kill_frontend, pause_frontend, restart_supervisor
    pid: int
    start_s: float
    ports: frozenset[int]  # client ports of its connections, read while it was stopped
    # restart_supervisor: every frontend stops, so every connection open at start_s or opened before
    # until_s (the server answering again) is struck, whatever its port
    until_s: float | None = None

    @property
    def name(self) -> str:
        return f"{self.kind} of frontend {self.pid} at t={self.start_s:.1f} s"


@dataclass
class FrontendMap:
    config: ChaosConfig
    target: ChaosTarget
    log: ChaosLog
    rng: random.Random
    # client port → [(t_s, frontend pid)], each time a sample saw the connection
    seen: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    cuts: list[FrontendCut] = field(default_factory=list)
    num_samples: int = 0

    @property
    def port(self) -> int:
        return int(urlsplit(self.target.url).port or 80)

    def ports_of(self, pid: int) -> frozenset[int]:
        """Client ports of the connections the process holds on the server's port."""
        try:
            connections = psutil.Process(pid).net_connections("tcp")
        except psutil.Error:
            return frozenset()
        return frozenset(c.raddr.port for c in connections if c.raddr and c.laddr.port == self.port)

    def sample(self) -> None:
        now = self.log.now()
        for pid in self.target.frontend_pids():
            for port in self.ports_of(pid):
                self.seen.setdefault(port, []).append((now, pid))
        self.num_samples += 1

    async def watch_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(every_s)

    def frontend_of(self, port: int | None, sent_s: float, ended_s: float) -> int | None:
        """The frontend that held the connection from `port` while the request was open (a sample saw it)."""
        for t_s, pid in self.seen.get(port or -1, ()):
            if sent_s - 1.0 <= t_s <= ended_s + 1.0:
                return pid
        return None

    def cut_of(self, port: int | None, sent_s: float, ended_s: float) -> FrontendCut | None:
        """The frontend fault that held the request's connection when it struck, if one did."""
        for cut in self.cuts:
            if port in cut.ports and sent_s <= cut.start_s <= ended_s:
                return cut
            if cut.until_s is not None and sent_s <= cut.until_s and cut.start_s <= ended_s:
                return cut
        return None

    # --- faults -----------------------------------------------------------------------------------------
    def _victim(self) -> psutil.Process | None:
        pids = [pid for pid in self.target.frontend_pids() if self.target.owns(pid)]
        if len(pids) < 2:  # one is being restarted: the other carries everything, leave it be
            self.log.event("frontend_fault_skipped", why=f"{len(pids)} frontend(s) up")
            return None
        try:
            return psutil.Process(self.rng.choice(pids))
        except psutil.NoSuchProcess:
            return None

    def _stop_and_note(self, kind: str, victim: psutil.Process) -> FrontendCut:
        victim.suspend()  # SIGSTOP: from here it accepts no connection, so the ports below are all it holds
        cut = FrontendCut(kind, victim.pid, self.log.now(), self.ports_of(victim.pid))
        self.cuts.append(cut)
        return cut

    async def kill_frontend(self) -> str:
        victim = self._victim()
        if victim is None:
            return "skipped (fewer than 2 frontends up)"
        cut = self._stop_and_note("kill_frontend", victim)
        victim.kill()
        self.log.event("kill_frontend", pid=cut.pid, num_connections=len(cut.ports), start_s=cut.start_s,
                       end_s=round(self.log.now(), 3))
        return "killed"

    async def pause_frontend(self) -> str:
        victim = self._victim()
        if victim is None:
            return "skipped (fewer than 2 frontends up)"
        pause_s = PAUSES_S[sum(c.kind == "pause_frontend" for c in self.cuts) % len(PAUSES_S)]  # each in turn
        cut = self._stop_and_note("pause_frontend", victim)
        await asyncio.sleep(pause_s)
        try:
            victim.resume()  # psutil checks that the pid is still this process
            result = f"{pause_s:g}s, resumed"
        except psutil.NoSuchProcess:
            result = f"{pause_s:g}s, killed by uvicorn meanwhile"
        self.log.event("pause_frontend", pid=cut.pid, pause_s=pause_s, result=result,
                       num_connections=len(cut.ports), start_s=cut.start_s, end_s=round(self.log.now(), 3))
        return result
