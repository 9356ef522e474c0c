"""A worker's step loop on its own thread, so the actor's event loop stays free while a forward runs.

    actor coroutine ──submit/abort (thread-safe call on the worker)──► wake()
    loop thread:   while running: delay = step(); wait(delay)   (None: until woken; 0: at once)
Only the loop thread touches engine state; other threads hand it commands through the worker's inbox.
A step that raises ends the loop: `on_error` runs on the loop thread (the worker ends every request it
holds with an error) and `error` stays set, so the actor reports itself failed and the gateway replaces it.
A step that never returns (a hung native call, a driver hang) raises nothing: running_s() tells how long the
current step has run, and longest_step_s the longest of the last RECENT_STEPS that finished, so that the
fleet's watchdog (gateway/fleet/recovery.py) can take a step far past the worker's own for hung. Recent, not
ever: one long first step (a warm-up, a compile) made every later hang wait ten times it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

RECENT_STEPS = 512  # the watchdog's measure of this worker's own steps: the longest of these


class StepLoop:
    def __init__(self, name: str, step: Callable[[], float | None], num_threads: int | None = None,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        """Args:
        name: thread name, for logs and py-spy.
        step: one iteration; returns how long to wait before the next (None: until wake()).
        on_error: called once on the loop thread when a step raises, before the loop ends.
        num_threads: torch threads for the forwards run on this thread. torch.set_num_threads() in the
            main thread does not reach a new thread's BLAS pool: without this a forward here uses every
            core, and on 2 cores the prefill and decode workers slow each other down ~2×.
        """
        self._step = step
        self._on_error = on_error
        self._num_threads = num_threads
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.error: BaseException | None = None
        self._step_began: float | None = None  # time.monotonic() at the running step's start; None: between
        self._recent_steps_s: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)

    def start(self) -> None:
        self._thread.start()

    @property
    def longest_step_s(self) -> float:
        """The longest of the last RECENT_STEPS steps that finished (any thread)."""
        return max(tuple(self._recent_steps_s), default=0.0)

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def running_s(self) -> float:
        """How long the step now running has run; 0 between steps."""
        began = self._step_began
        return 0.0 if began is None else time.monotonic() - began

    def _run(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        while not self._stopped.is_set():
            self._step_began = began = time.monotonic()
            try:
                delay = self._step()
            except BaseException as error:  # a dead loop must be visible, not a silent hang
                logger.exception("step loop %s died", self._thread.name)
                self.error = error
                if self._on_error is not None:
                    try:
                        self._on_error(error)
                    except Exception:
                        logger.exception("step loop %s: failing its requests raised too", self._thread.name)
                return
            finally:
                self._step_began = None
            self._recent_steps_s.append(time.monotonic() - began)
            if delay == 0:
                continue
            self._wake.wait(delay)
            self._wake.clear()
