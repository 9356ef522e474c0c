"""What a worker's bring-up says while it happens: one line per event, with the seconds since the worker was
created, so that a start-up of minutes (Ray placing workers, each loading the model on its node) is not
silent.

    created (PENDING) → placed: Ray put it on a node → loading: the model is found there and loaded, its KV
    cache sized → loaded (or failed) → wired to its peers → ACTIVE (gateway/fleet/table.py)
Start-up's workers, a late one, a replacement and one added by PUT /admin/pools say the same lines. Start-up
(PDDeployment.start) runs inside start_up(), which says what starts and, once it is over, how long it took;
meanwhile, where stderr is a terminal, a bar counts the workers loaded. The lines are printed, as the
gateway's other start-up lines are (gateway/startup.py): in the fleet actor, whose
logging Ray does not show at info, Ray forwards its stdout.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel

if TYPE_CHECKING:
    from gateway.fleet.workers import Worker

Phase = Literal["created", "placed", "loading", "loaded", "failed"]


class WorkerStart(BaseModel):
    """One worker's way through start-up, as the lines below say it."""

    worker_id: str
    role: str
    phase: Phase  # created: waiting for Ray to place it on a node
    node_ip: str | None = None
    since_created_s: float


class StartProgress(BaseModel):
    """How far start-up has come: what /health answers while the fleet starts (gateway/start_answerer.py)."""

    status: Literal["starting"] = "starting"
    elapsed_s: float
    loaded: int  # workers whose model is loaded
    total: int  # workers being started (adopted ones are not counted: they are up already)
    workers: list[WorkerStart] = []


def say(line: str) -> None:
    print(f"pdserve: {line}", flush=True)


def since_created(worker: Worker) -> float:
    return time.monotonic() - worker.created_at


class BringUpLog:
    """Says each worker's bring-up events (see the module docstring)."""

    def __init__(self, write: Callable[[str], None] = say, is_terminal: Callable[[], bool] | None = None
                 ) -> None:
        """Args:
            is_terminal: whether to draw the bar (default: whether stderr is a terminal when start-up runs).
        """
        self._write = write
        self._is_terminal = is_terminal or (lambda: sys.stderr.isatty())
        self._loading_since: dict[str, float] = {}  # worker id → when its load began (removed once it ends)
        self._bar: Any = None  # tqdm's bar while start-up runs on a terminal
        # While start-up runs: its workers, each one's phase, when it began (progress() reads them)
        self._starting: list[Worker] = []
        self._phase: dict[str, Phase] = {}
        self._began: float | None = None

    @contextmanager
    def start_up(self, workers: list[Worker]) -> Iterator[None]:
        """Around start-up's bring-up of `workers` (none: every worker was adopted): a line before, a bar on a
        terminal while it runs, a line once it is over (not when it fails: the error says why)."""
        began = self._began = time.monotonic()
        self._starting = list(workers)
        self._phase = {w.worker_id: "created" for w in workers}
        if workers:
            counts = Counter(w.role.value for w in workers)
            layout = ", ".join(f"{count} {role}" for role, count in counts.items())
            self._write(f"starting {len(workers)} workers ({layout}): Ray places each on a node, where it "
                        "loads the model")
            if self._is_terminal():
                from tqdm import tqdm

                self._bar = tqdm(total=len(workers), desc="pdserve: workers loaded", unit="worker",
                                 file=sys.stderr, leave=False)
        try:
            yield
        finally:
            self._starting, self._began = [], None
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        if workers:
            num_up = sum(w.is_active for w in workers)
            self._write(f"{num_up} of {len(workers)} workers up in {time.monotonic() - began:.1f} s")

    def progress(self) -> StartProgress | None:
        """How far start-up has come; None when it is not running."""
        if self._began is None:
            return None
        workers = [WorkerStart(worker_id=w.worker_id, role=w.role.value, phase=self._phase.get(w.worker_id,
                                                                                               "created"),
                               node_ip=w.node_ip, since_created_s=round(since_created(w), 1))
                   for w in self._starting]
        return StartProgress(elapsed_s=round(time.monotonic() - self._began, 1),
                             loaded=sum(w.phase == "loaded" for w in workers), total=len(workers),
                             workers=workers)

    def _note(self, worker: Worker, phase: Phase) -> None:
        if worker.worker_id in self._phase:
            self._phase[worker.worker_id] = phase

    def placed(self, worker: Worker) -> None:
        self._note(worker, "placed")
        self._say(f"{worker.worker_id} ({worker.role.value}): placed on node {worker.node_ip} (pid "
                  f"{worker.pid}) after {since_created(worker):.1f} s")

    def loading(self, worker: Worker) -> None:
        self._loading_since[worker.worker_id] = time.monotonic()
        self._note(worker, "loading")
        self._say(f"{worker.worker_id} ({worker.role.value}): loading the model on its node "
                  f"({since_created(worker):.1f} s)")

    def loaded(self, worker: Worker) -> None:
        load_s = time.monotonic() - self._loading_since.pop(worker.worker_id, time.monotonic())
        self._note(worker, "loaded")
        if self._bar is not None:
            self._bar.update(1)
        self._say(f"{worker.worker_id} ({worker.role.value}): model loaded in {load_s:.1f} s "
                  f"({since_created(worker):.1f} s since it was created)")

    def failed(self, worker: Worker, error: BaseException) -> None:
        self._loading_since.pop(worker.worker_id, None)
        self._note(worker, "failed")
        why = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        self._say(f"{worker.worker_id} ({worker.role.value}): did not start ({since_created(worker):.1f} s "
                  f"since it was created): {why}")

    def _say(self, line: str) -> None:
        if self._bar is None:
            self._write(line)
            return
        with self._bar.external_write_mode(file=sys.stdout):  # the bar steps aside for the line
            self._write(line)


def announce_kv(workers: list[Worker]) -> None:
    """One line per worker: its KV capacity and how it was sized (also in GET /admin/pools)."""
    for worker in workers:
        kv = worker.runtime
        if kv is not None:
            print(f"pdserve: {worker.worker_id} ({worker.role.value}): KV cache {kv.num_kv_blocks} blocks = "
                  f"{kv.num_kv_tokens} tokens, {kv.kv_cache_bytes / (1 << 20):.1f} MiB "
                  f"(from {kv.kv_cache_source})", flush=True)
