"""Start-up says what it does (gateway/fleet/bring_up_log.py): a line per worker as Ray places it and as it
loads the model, each with its seconds, through the real placement wait (gateway/fleet/placement.py) over
workers whose actors answer after a delay, or never (no node for them). No Ray: the answers are scripted
here; a whole server's lines are checked in tests/gateway/test_model_ids.py."""

from __future__ import annotations

import asyncio
import re

import pytest

from gateway.fleet.bring_up_log import BringUpLog
from gateway.fleet.placement import wait_all_placed
from gateway.fleet.workers import Worker, WorkerState
from worker_runtime.info import WorkerPlacement
from worker_runtime.roles import Role


class Placing:
    """A worker's actor as placement sees it: placed after `delay_s`, or never (None)."""

    def __init__(self, delay_s: float | None, pid: int) -> None:
        self.delay_s, self.pid = delay_s, pid

    async def placement(self) -> WorkerPlacement:
        if self.delay_s is None:
            await asyncio.Event().wait()  # no node offers what it asks for
        await asyncio.sleep(self.delay_s or 0)
        return WorkerPlacement("node-1", "10.0.0.7", self.pid)


def pending(worker_id: str, role: Role, delay_s: float | None, pid: int = 1) -> Worker:
    return Worker(worker_id, role, Placing(delay_s, pid), WorkerState.PENDING)  # type: ignore[arg-type]


def test_each_worker_says_when_it_is_placed_and_loaded() -> None:
    lines: list[str] = []
    log = BringUpLog(write=lines.append, is_terminal=lambda: False)
    workers = [pending("w-0", Role.PREFILL, 0.05, pid=11), pending("w-1", Role.DECODE, 0.15, pid=12),
               pending("w-2", Role.DECODE, None)]

    phases: list[dict[str, str]] = []  # what /health says while starting, after each step

    def note_progress() -> None:
        progress = log.progress()
        assert progress is not None and progress.total == 3
        assert progress.loaded == sum(w.phase == "loaded" for w in progress.workers)
        phases.append({w.worker_id: w.phase for w in progress.workers})

    async def start_up() -> None:
        with log.start_up(workers):
            note_progress()
            await wait_all_placed(workers, 0.5, log.placed)
            note_progress()
            placed = [w for w in workers if w.state is WorkerState.STARTING]
            for worker in placed:
                log.loading(worker)
            note_progress()
            await asyncio.sleep(0.05)
            log.loaded(placed[0])
            log.failed(placed[1], TimeoutError())
            note_progress()
            placed[0].state = WorkerState.ACTIVE

    assert log.progress() is None
    asyncio.run(start_up())
    assert log.progress() is None  # start-up is over: /health answers from the fleet
    assert phases == [{"w-0": "created", "w-1": "created", "w-2": "created"},
                      {"w-0": "placed", "w-1": "placed", "w-2": "created"},
                      {"w-0": "loading", "w-1": "loading", "w-2": "created"},
                      {"w-0": "loaded", "w-1": "failed", "w-2": "created"}]
    assert lines[0] == ("starting 3 workers (1 prefill, 2 decode): Ray places each on a node, where it loads "
                        "the model")
    assert re.fullmatch(r"w-0 \(prefill\): placed on node 10\.0\.0\.7 \(pid 11\) after 0\.\d s", lines[1])
    assert re.fullmatch(r"w-1 \(decode\): placed on node 10\.0\.0\.7 \(pid 12\) after 0\.\d s", lines[2])
    seconds = float(re.findall(r"after (\S+) s", lines[2])[0])
    assert 0.1 <= seconds < 0.5  # counted from the worker's creation
    assert re.fullmatch(r"w-0 \(prefill\): loading the model on its node \(0\.\d s\)", lines[3])
    assert lines[4].startswith("w-1 (decode): loading the model on its node")
    since = r"\(0\.\d s since it was created\)"
    assert re.fullmatch(rf"w-0 \(prefill\): model loaded in 0\.\d s {since}", lines[5])
    assert re.fullmatch(rf"w-1 \(decode\): did not start {since}: TimeoutError", lines[6])
    assert re.fullmatch(r"1 of 3 workers up in 0\.\d s", lines[7])
    assert len(lines) == 8  # nothing for the worker no node took: start-up's warning names it


def test_a_worker_placed_twice_is_said_once() -> None:
    lines: list[str] = []
    log = BringUpLog(write=lines.append, is_terminal=lambda: False)
    worker = pending("w-0", Role.MIXED, 0.0)

    async def place_twice() -> None:  # add_worker waits for the placement, then bring_up asks again
        await wait_all_placed([worker], 1.0, log.placed)
        await wait_all_placed([worker], 1.0, log.placed)

    asyncio.run(place_twice())
    assert len(lines) == 1 and lines[0].startswith("w-0 (mixed): placed on node")


def test_a_terminal_gets_a_bar_beside_the_lines(capsys: pytest.CaptureFixture[str]) -> None:
    lines: list[str] = []
    log = BringUpLog(write=lines.append, is_terminal=lambda: True)
    workers = [pending("w-0", Role.PREFILL, 0.0), pending("w-1", Role.DECODE, 0.0)]
    with log.start_up(workers):
        for worker in workers:
            log.loading(worker)
            log.loaded(worker)
            worker.state = WorkerState.ACTIVE
    bar = capsys.readouterr().err
    assert "pdserve: workers loaded" in bar and "2/2" in bar
    assert sum("model loaded" in line for line in lines) == 2 and lines[-1].startswith("2 of 2 workers up")


def test_a_failed_start_up_closes_the_bar_and_says_no_total() -> None:
    lines: list[str] = []
    log = BringUpLog(write=lines.append, is_terminal=lambda: True)
    with pytest.raises(RuntimeError), log.start_up([pending("w-0", Role.DECODE, 0.0)]):
        raise RuntimeError("placement timed out")
    assert len(lines) == 1 and log._bar is None
