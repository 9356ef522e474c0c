"""Faults injected into real worker actors through Ray's `__ray_call__` (a function run on the actor
instance): a step made slow or made to raise, a pull made to fail or to hang, explicit releases lost.
Pickled by value: the workers do not import the tests. heal() undoes every one of them."""

from __future__ import annotations

import sys
import time
from typing import Any

import ray


def slow_steps(actor: Any, seconds: float) -> None:
    runner = actor.worker.engine.runner
    execute = type(runner).execute

    def slowed(batch: Any) -> Any:
        time.sleep(seconds)
        return execute(runner, batch)

    runner.execute = slowed


def raise_in_next_step(actor: Any) -> None:
    def broken(batch: Any) -> Any:
        raise RuntimeError("injected fault: the forward failed")

    actor.worker.engine.runner.execute = broken


def raise_in_steps_with_seed(actor: Any, seed: int) -> None:
    """A query of death: every step whose batch holds a request sampled with `seed` raises."""
    runner = actor.worker.engine.runner
    execute = runner.execute  # slow_steps' wrapper, if installed first

    def broken(batch: Any) -> Any:
        if any(c.sampling is not None and c.sampling.seed == seed for c in batch.chunks):
            raise RuntimeError("injected fault: this request breaks every forward it is in")
        return execute(batch)

    runner.execute = broken


def hold_steps(actor: Any) -> None:
    """Every step waits at a gate until release_steps() (the step loop stops; commands queue in the inbox)."""
    import threading

    runner = actor.worker.engine.runner
    execute = type(runner).execute
    gate = actor.__dict__.setdefault("fault_gate", threading.Event())
    gate.clear()

    def held(batch: Any) -> Any:
        gate.wait(60)
        return execute(runner, batch)

    runner.execute = held


def release_steps(actor: Any) -> None:
    gate = actor.__dict__.get("fault_gate")
    if gate is not None:
        gate.set()


def count_loads(actor: Any) -> None:
    """Count the load reports the worker gives from now on (read with num_loads)."""
    worker = actor.worker
    load = type(worker).load
    actor.__dict__["num_loads"] = 0

    def counted() -> Any:
        actor.__dict__["num_loads"] += 1
        return load(worker)

    worker.load = counted


def num_loads(actor: Any) -> int:
    return int(actor.__dict__.get("num_loads", 0))


def refuse_pull_calls(actor: Any) -> None:
    """A prefill worker whose accept_pull raises (torch backend: the decode side's call fails)."""

    def broken(pull: Any) -> Any:
        raise RuntimeError("injected fault: accept_pull failed")

    actor.worker.accept_pull = broken


def fail_pulls(actor: Any) -> None:
    actor.worker.receiver._start = lambda pull, peer: pull.fail("injected fault: the transfer was dropped")


def stall_pulls(actor: Any) -> None:
    from kv_transfer import TransferState

    def stalled(pull: Any, peer: Any) -> None:
        pull.state = TransferState.TRANSFERRING  # posted, and never heard of again

    actor.worker.receiver._start = stalled
    actor.worker.receiver._advance = lambda pull: None
    # Like a READ NIXL cannot cancel: an abort does not stop it; only its deadline does.
    actor.worker.receiver._abort = lambda pull: time.monotonic() > pull.deadline


def _kv_sender(actor: Any) -> Any:
    """The worker's KV sender: a prefill worker's own, a decode or mixed worker's migration sender (None:
    it has none)."""
    offers = actor.worker.offers
    return getattr(offers, "sender", None)


def lose_releases_and_shorten_leases(actor: Any) -> None:
    import dataclasses

    actor.worker.release_kv = lambda transfer_id, why: None  # explicit releases never arrive
    sender = _kv_sender(actor)
    if sender is None:
        raise ValueError("this worker sends no KV: no lease to shorten")
    actor.__dict__.setdefault("lease_s", sender.config.lease_s)  # heal() puts it back
    sender.config = dataclasses.replace(sender.config, lease_s=1.0)


def hang_loads(actor: Any, seconds: float) -> None:
    """Every load call holds the actor's event loop for `seconds`: a worker that stops answering."""
    load = actor.worker.load

    def hung() -> Any:
        time.sleep(seconds)
        return load()

    actor.worker.load = hung


def heal(actor: Any) -> None:
    release_steps(actor)
    actor.worker.engine.runner.__dict__.pop("execute", None)
    actor.worker.__dict__.pop("release_kv", None)
    actor.worker.__dict__.pop("load", None)
    actor.worker.__dict__.pop("accept_pull", None)
    sender = _kv_sender(actor)
    lease_s = actor.__dict__.pop("lease_s", None)
    if sender is not None and lease_s is not None:
        import dataclasses

        sender.config = dataclasses.replace(sender.config, lease_s=lease_s)
    receiver = getattr(actor.worker, "receiver", None)
    if receiver is not None:
        receiver.__dict__.pop("_advance", None)
        receiver.__dict__.pop("_start", None)
        receiver.__dict__.pop("_abort", None)


ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def refuse_grammars(actor: Any) -> None:
    """Every grammar fails to compile on this worker, as one the gateway's check accepts but the worker's
    vocabulary-bound compilation refuses would."""
    from llm_engine.structured import GrammarError

    def refuse(spec: Any) -> Any:
        raise GrammarError("injected fault: the grammar does not compile against this vocabulary")

    actor.engine.runner.grammar_mask.cache.compile = refuse
