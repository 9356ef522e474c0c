"""Review P7: a worker's helper threads (the pull watcher, the KV offers' poller) that hit an exception do not
end in silence: the step loop's next call raises it (HelperThreadFailed, the cause chained), which fails the
worker the one way a worker fails. Real transfer halves (the local backend) over a real engine's KV cache; the
fault is a poll made to raise."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from decode_pool.pull_watcher import PullWatcher
from kv_transfer import make_receiver, make_sender
from tests.helpers.engines import make_engine
from worker_runtime.kv_offers import KVOffers
from worker_runtime.thread_failure import HelperThreadFailed


def broken_poll() -> list[object]:
    raise RuntimeError("injected fault: a rank of the group is gone")


def test_a_pull_watcher_that_dies_fails_the_loop_at_its_next_take(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=8)
    receiver = make_receiver("local", "d0", engine.runner.kv_cache)
    woken = threading.Event()
    watcher = PullWatcher(receiver, woken.set, lambda pull: None, "d0-pulls")
    receiver.poll = broken_poll  # type: ignore[method-assign]
    watcher.start()
    watcher.watch()
    assert woken.wait(10)  # the loop is woken, not left asleep with pulls in flight
    del receiver.poll  # the receiver works again: the watcher thread is still gone
    watcher.wait_finished(10)  # returns at once: nothing to wait for from a dead watcher
    with pytest.raises(HelperThreadFailed, match="d0-pulls failed: RuntimeError: injected fault") as raised:
        watcher.take()
    assert isinstance(raised.value.__cause__, RuntimeError)
    watcher.stop()


def test_a_kv_offers_poller_that_dies_fails_the_loop_at_its_next_poll(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=8)
    sender = make_sender("local", "p0", engine.runner.kv_cache)
    offers = KVOffers(sender, engine.kv, "p0-prefill")
    engine.kv.allocate("r0", list(range(20)), 20)
    offers.offer("r0", 20)  # a lease out: the poller polls
    woken = threading.Event()
    sender.poll = broken_poll  # type: ignore[method-assign]
    offers.start_polling(woken.set)
    assert woken.wait(10)
    del sender.poll
    with pytest.raises(HelperThreadFailed, match="p0-prefill failed: RuntimeError: injected fault"):
        offers.poll()
