"""The step loop runs forwards with the worker's thread count (a new thread does not inherit it)."""

from __future__ import annotations

import threading
import time

import torch

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
