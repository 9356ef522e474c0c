"""The step loop runs forwards with the worker's thread count (a new thread does not inherit it)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from worker_runtime import step_loop
from worker_runtime.step_loop import StepLoop


def cpu_per_wall_second_of_matmuls_in_loop(num_threads: int | None) -> float:
    matrix = torch.randn(1024, 1024)
    done = threading.Event()
    ratio: list[float] = []

    def step() -> float | None:
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(30):
            matrix @ matrix
        ratio.append((time.process_time() - cpu) / (time.perf_counter() - wall))
        done.set()
        return None

    loop = StepLoop("test", step, num_threads)
    loop.start()
    assert done.wait(60)
    loop.stop()
    return ratio[0]


def test_loop_thread_keeps_to_one_core() -> None:
    # Whatever else the machine does, one thread cannot burn more than one CPU-second per second.
    assert cpu_per_wall_second_of_matmuls_in_loop(1) < 1.2


def test_loop_reports_a_dead_step() -> None:
    def broken() -> float | None:
        raise RuntimeError("boom")

    loop = StepLoop("broken", broken)
    loop.start()
    for _ in range(100):
        if loop.error is not None:
            break
        time.sleep(0.01)
    assert isinstance(loop.error, RuntimeError) and not loop.is_alive


def test_the_longest_step_is_of_the_recent_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review LOW: the watchdog's measure only grew, so one long first step (a warm-up) made every later hang
    wait ten times it; it is the longest of the last RECENT_STEPS now."""
    monkeypatch.setattr(step_loop, "RECENT_STEPS", 4)
    durations = [0.2] + [0.01] * 6
    done = threading.Event()

    def step() -> float | None:
        if not durations:
            done.set()
            return None
        time.sleep(durations.pop(0))
        return 0.0

    loop = step_loop.StepLoop("recent", step)
    assert loop.longest_step_s == 0.0
    loop.start()
    assert done.wait(10)
    assert 0.005 < loop.longest_step_s < 0.1  # the 0.2 s first step is out of the window
    loop.stop()
