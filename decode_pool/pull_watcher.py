"""Watches a decode worker's KV pulls on a thread of its own, so that a pull's end is noticed when it
happens, not at the step loop's next step.

    loop thread:    with watcher.lock: receiver.start_pull(...) ... watcher.watch()   (a pull is in flight)
    watcher thread: while any pull is in flight: every poll_s, with watcher.lock: receiver.poll()
                    → each finished pull is stamped with the time it was seen finished, pull requests for
                      the senders are delivered at once, and the step loop is woken
    loop thread:    watcher.take() (at each step's start) → the finished pulls, with their times
A pull advances in several hops (NIXL: claim → the sender's grant → READ → done), each seen only by a poll:
polled only between forwards, a pull took two or three steps however fast its bytes moved. The receiver is
not thread-safe: every call on it, from either thread, holds `lock`; the engine is still the loop thread's
alone (the watcher only hands results over). A poll that raises on the watcher thread (a dead tensor-parallel
rank, a failed copy) ends it and is raised by the loop's next take(): the worker fails, never silently
(worker_runtime/thread_failure.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kv_transfer import KVReceiver, PullRequest, TransferResult
from worker_runtime.thread_failure import ThreadFailure

POLL_S = 0.001  # between polls while a pull is in flight


class PullWatcher:
    def __init__(self, receiver: KVReceiver, on_finished: Callable[[], None],
                 deliver_pull: Callable[[PullRequest], None], name: str) -> None:
        """Args:
        on_finished: called (on the watcher thread) when a pull finished: wakes the step loop.
        deliver_pull: carries a PullRequest to its sender (backends whose sender takes part); thread-safe.
        """
        self.receiver = receiver
        self.lock = threading.Lock()  # held for every call on the receiver
        self._on_finished = on_finished
        self._deliver_pull = deliver_pull
        self._finished: list[tuple[TransferResult, float]] = []  # seen by the watcher, not yet taken
        self._in_flight = threading.Event()  # set while the receiver holds a pull
        self._news = threading.Condition(self.lock)  # notified when a poll saw pulls finish
        self._is_stopped = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._failure = ThreadFailure(f"the pull watcher thread {name}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._is_stopped = True
        self._in_flight.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def watch(self) -> None:
        """A pull was started (call holding `lock`, right after start_pull)."""
        self._in_flight.set()

    def take(self) -> list[tuple[TransferResult, float]]:
        """Every pull finished since the last take(), with the wall-clock time it was seen finished
        (loop thread). Polls once itself too, so it works without the thread (tests that step by hand).
        Raises HelperThreadFailed once the watcher thread has died."""
        self._failure.raise_if_any()
        with self.lock:
            self._poll()
            finished, self._finished = self._finished, []
        return finished

    def wait_finished(self, timeout: float) -> None:
        """Wait until no pull is in flight (each seen finished by the watcher thread, for take()), at most
        `timeout` seconds (loop thread, with the watcher running)."""
        with self._news:
            self._news.wait_for(lambda: not self.receiver.num_pulls or self._failure.happened, timeout)

    def _poll(self) -> None:
        """One poll of the receiver (holding `lock`)."""
        results = self.receiver.poll()
        for pull in self.receiver.take_pull_requests():
            self._deliver_pull(pull)
        if results:
            now = time.time()
            self._finished.extend((result, now) for result in results)
            self._news.notify_all()
        if not self.receiver.num_pulls:
            self._in_flight.clear()

    def _run(self) -> None:
        try:
            while not self._is_stopped:
                self._in_flight.wait()
                if self._is_stopped:
                    return
                with self.lock:
                    num_finished = len(self._finished)
                    self._poll()
                    has_news = len(self._finished) > num_finished
                if has_news:
                    self._on_finished()
                time.sleep(POLL_S)
        except BaseException as error:
            with self.lock:
                self._failure.record(error)
                self._news.notify_all()
            self._on_finished()  # the loop wakes and raises it
