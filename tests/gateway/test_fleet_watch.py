"""The supervisor's watch over its fleet actor (gateway/fleet_supervisor.py watch_fleet), driven by a scripted
probe (no Ray cluster): a fleet Ray is still restarting is waited for however long it takes, and started
again once it answers; only a fleet Ray reports dead for good stops the gateway."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

from gateway import fleet_supervisor


class ScriptedFleet:
    """probe_started() answers from a script: an exception to raise, or what to return."""

    def __init__(self, script: Iterator[object]) -> None:
        self.script = script

    def probe_started(self, timeout_s: float) -> object:
        answer = next(self.script)
        if isinstance(answer, Exception):
            raise answer
        return answer


def watch(script: list[object], monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], int]:
    monkeypatch.setattr(fleet_supervisor, "FLEET_WATCH_S", 0.001)
    monkeypatch.setattr(fleet_supervisor, "FLEET_GONE_S", 0.05)
    stopping = threading.Event()
    lost: list[str] = []
    starts: list[object] = []

    def steps() -> Iterator[object]:
        yield from script
        stopping.set()
        while True:
            yield "started"

    fleet_supervisor.watch_fleet(ScriptedFleet(steps()), starts.append, lost.append, stopping)  # type: ignore[arg-type]
    return lost, len(starts)


def test_a_fleet_ray_takes_long_to_restart_is_waited_for_then_started_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    restarting = [ActorUnavailableError("restarting", None)] * 500  # far past FLEET_GONE_S at 1 ms a probe
    lost, num_starts = watch([*restarting, None, "started"], monkeypatch)
    assert lost == [] and num_starts == 1


def test_a_fleet_ray_reports_dead_stops_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    lost, num_starts = watch([ActorDiedError()] * 500, monkeypatch)
    assert len(lost) == 1 and "gone" in lost[0] and num_starts == 0
