"""The controller's planner: the layout it predicts follows the traffic, and the controller moves on a
prediction only when it is confirmed, better by the margin, and not against the ladder's guards.

Pure: the tuner's simulator with known step costs (tests/helpers/tuning.py), synthetic arrivals; no Ray.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gateway.ratio.controller import RatioController
from gateway.ratio.ladder import ControllerPolicy, Signals
from gateway.ratio.planner import LayoutPlanner
from gateway.requests.router import LocalPrefillPolicy
from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.traffic import Arrival, RecentTraffic
from loadgen.summary import SLO
from tests.helpers.tuning import poisson_arrivals, sim_config, step_model
from tuner.simulator import Layout

# Prompts cost 2 ms a token; a decode step 30 ms + 1 ms per request in the batch.
MODEL = step_model(prefill=(0.01, 0.002, 0.0), decode=(0.03, 0.001, 0.0))
SLO_ = SLO(ttft_s=20.0, itl_s=0.05)
LADDER = [Layout(0, 0, 2), Layout(1, 1, 0)]


def long_prompts_beside_streams(end: float) -> list[Arrival]:
    """1500-token prompts among streams of 300 tokens: on mixed workers every step carries a prompt slice."""
    return sorted(poisson_arrivals(1500, 16, 0.2, 20, 1, end) + poisson_arrivals(64, 300, 0.5, 80, 2, end),
                  key=lambda a: a.at)


def busy_chat(end: float) -> list[Arrival]:
    """Short prompts, long answers, 1.5 req/s: one decode worker's batch is too slow for the ITL SLO."""
    return poisson_arrivals(64, 300, 1.5, 120, 3, end)


def test_the_predicted_layout_follows_the_traffic() -> None:
    planner = LayoutPlanner(MODEL, sim_config(), SLO_, LADDER)
    now = time.time()
    disaggregate = planner.predict(long_prompts_beside_streams(now))
    colocate = planner.predict(busy_chat(now))
    assert disaggregate is not None and disaggregate.best == Layout(1, 1, 0)
    assert colocate is not None and colocate.best == Layout(0, 0, 2)
    assert planner.predict(busy_chat(now)[:5]) is None  # too few requests to say


@dataclass
class Books:
    """The routers' counts as the controller reads them (test data: nothing queued)."""

    local_prefill: LocalPrefillPolicy = field(default_factory=LocalPrefillPolicy)
    on_local_prefill: list[Callable[[int], None]] = field(default_factory=list)


def signals(level: int, seconds_since_long_prompt: float = 1e9) -> Signals:
    return Signals(level=level, num_workers=2, queued_prompt_tokens=0, num_decoding=4, kv_occupancy=0.1,
                   ttft_p90_s=None, tpot_p90_s=None, itl_p50_s=None, longest_pending_prompt=0,
                   longest_prompt_beside_streams=0, seconds_since_long_prompt=seconds_since_long_prompt)


def test_the_controller_moves_on_a_confirmed_prediction_and_keeps_it() -> None:
    traffic = RecentTraffic(window_s=600)
    policy = ControllerPolicy(plan_interval_s=0.0, min_dwell_s=0.0, plan_confirmations=2, ttft_slo_s=20.0,
                              itl_slo_s=0.05)
    # A fleet whose streams cannot move off a long prompt's worker (move_streams_from_tokens 0): there,
    # long prompts among streams call for 1P+1D by far more than the margin. (Where they can move, all
    # mixed comes within it: test_the_predicted_layout_follows_the_traffic still names 1P+1D the best.)
    config = replace(sim_config(), move_streams_from_tokens=0)
    controller = RatioController(None, Books(), None, RecentLatencies(), policy,  # type: ignore[arg-type]
                                 planner=LayoutPlanner(MODEL, config, SLO_, LADDER), traffic=traffic)

    async def plan(s: Signals) -> object:
        return await controller._plan(s)

    for arrival in long_prompts_beside_streams(time.time()):
        traffic.add(arrival)
    assert asyncio.run(plan(signals(0))) is None  # named once: not yet
    decision = asyncio.run(plan(signals(0)))
    assert decision is not None
    assert (decision.from_level, decision.to_level, decision.reason) == (0, 1, "plan")
    assert decision.prediction is not None and decision.prediction["best"] == "1P+1D"
    assert "1P+1D" in decision.detail and "2M" in decision.detail
    # The traffic turns into busy chat: back to all mixed, but not while a long prompt is about (the guard).
    traffic = controller.traffic = RecentTraffic(window_s=600)
    for arrival in busy_chat(time.time()):
        traffic.add(arrival)
    assert asyncio.run(plan(signals(1, seconds_since_long_prompt=1.0))) is None
    assert asyncio.run(plan(signals(1, seconds_since_long_prompt=1.0))) is None
    # Confirmed while the guard held it back: once the long prompts are gone, it moves at once.
    decision = asyncio.run(plan(signals(1)))
    assert decision is not None and (decision.from_level, decision.to_level) == (1, 0)
    assert decision.prediction is not None and decision.prediction["best"] == "2M"


def test_a_layout_predicted_no_better_than_the_margin_is_not_moved_to() -> None:
    traffic = RecentTraffic(window_s=600)
    for arrival in poisson_arrivals(64, 128, 1.0, 60, 4, time.time()):  # light chat: both layouts hold it
        traffic.add(arrival)
    policy = ControllerPolicy(plan_interval_s=0.0, min_dwell_s=0.0, plan_confirmations=1, ttft_slo_s=20.0,
                              itl_slo_s=0.05)
    controller = RatioController(None, Books(), None, RecentLatencies(), policy,  # type: ignore[arg-type]
                                 planner=LayoutPlanner(MODEL, sim_config(), SLO_, LADDER), traffic=traffic)
    for level in (0, 1):
        assert asyncio.run(controller._plan(signals(level))) is None


class IdleController(RatioController):
    """The controller's loop with nothing to decide (no fleet here): what is tested is that it stops."""

    async def tick(self) -> None:  # type: ignore[override]
        return None


def test_the_controller_stops_even_when_a_cancel_lands_as_a_long_prompt_wakes_it() -> None:
    """Like the frontend's report loop (tests/gateway/test_remote_fleet_join.py): the controller waited with
    asyncio.wait_for, which in Python 3.11 loses a cancel that lands as its inner wait finishes; `PUT
    /admin/pools {"auto": false}` would then wait on a loop that never ends. Each round wakes the loop (a
    long prompt noted) as it stops it."""
    policy = ControllerPolicy(interval_s=3600.0)

    async def rounds() -> int:
        num_stopped = 0
        for i in range(200):
            controller = IdleController(None, Books(), None, RecentLatencies(), policy)  # type: ignore[arg-type]
            controller.start()
            await asyncio.sleep(0.001 * (i % 4))
            controller.note_prompt(1 << 20)
            await asyncio.wait_for(controller.stop(), 5.0)
            num_stopped += 1
        return num_stopped

    assert asyncio.run(rounds()) == 200
