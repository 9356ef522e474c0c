"""RecentTraffic (the window the ratio and scale planners replay): a request counts from its arrival, its
output estimated until it finishes; bounded where it is noted. Pure: no server, synthetic notes."""

from __future__ import annotations

import time

from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.sizing import ScalePolicy, plan_size
from gateway.telemetry.traffic import OUTPUT_GUESS_TOKENS, Arrival, RecentTraffic, TrafficNote
from loadgen.summary import SLO
from tests.helpers.tuning import poisson_arrivals, sim_config, step_model

# As tests/gateway/test_scale_sizing.py's: one worker holds the 50 ms ITL SLO up to about 0.6 req/s of
# 300-token answers, two up to about 1.6.
MODEL = step_model(prefill=(0.01, 0.002, 0.0), decode=(0.03, 0.001, 0.0))
POLICY = ScalePolicy(min_workers=1, max_workers=3)


def test_a_request_counts_from_its_arrival_and_its_finish_replaces_the_estimate() -> None:
    traffic = RecentTraffic(window_s=60.0)
    now = time.time()
    traffic.note(TrafficNote("a", now - 5, 100, max_tokens=1000))
    traffic.note(TrafficNote("b", now - 4, 50, max_tokens=16))
    # Nothing finished yet: a running request's output is the guess, at most its max_tokens.
    assert traffic.window() == [Arrival(now - 5, 100, OUTPUT_GUESS_TOKENS), Arrival(now - 4, 50, 16)]
    traffic.note(TrafficNote("a", now - 5, 100, max_tokens=1000, output_tokens=40))
    # Finished: its own count; the running one's estimate is now the finished ones' mean (under its cap).
    traffic.note(TrafficNote("c", now - 3, 10, max_tokens=1000))
    assert traffic.window() == [Arrival(now - 5, 100, 40), Arrival(now - 4, 50, 16), Arrival(now - 3, 10, 40)]
    # Out of the window, not counted; in it whatever its order of notes.
    assert traffic.window(now=now + 56.5) == [Arrival(now - 3, 10, 40)]


def test_the_notes_are_bounded_by_age_and_count() -> None:
    traffic = RecentTraffic(window_s=10.0, max_requests=50)
    now = time.time()
    for i in range(200):
        traffic.note(TrafficNote(f"old-{i}", now - 30, 8, 8))  # older than twice the window: dropped
    traffic.note(TrafficNote("new", now, 8, 8))
    assert traffic.window() == [Arrival(now, 8, 8)]
    for i in range(200):
        traffic.note(TrafficNote(f"r{i}", now, 8, 8))
    assert len(traffic.window()) == 50


def test_a_burst_still_waiting_is_planned_for_before_any_of_it_finishes() -> None:
    """The burst's requests have arrived and none has finished: counted from their arrival, the plan names
    a larger size at once (counted at their finish, the window would still hold the light traffic alone)."""
    now = time.time()
    light = poisson_arrivals(64, 300, 0.3, 15, seed=7, end=now - 20)  # finished
    burst = poisson_arrivals(64, 300, 2.0, 30, seed=8, end=now)  # arrived, none finished
    burst = [a for a in burst if a.at > light[-1].at]
    planner = LayoutPlanner(MODEL, sim_config(), SLO(ttft_s=5.0, itl_s=0.05), POLICY.candidates,
                             POLICY.min_requests)
    traffic = RecentTraffic(window_s=600)
    for index, light_one in enumerate(light):
        traffic.note(TrafficNote(f"light-{index}", light_one.at, 64, 300, light_one.output_tokens))
    before = plan_size(planner, traffic.window(), POLICY)
    for index, arrival in enumerate(burst):  # arrived, none finished
        traffic.note(TrafficNote(f"burst-{index}", arrival.at, arrival.prompt_tokens, 300))
    after = plan_size(planner, traffic.window(), POLICY)
    assert before is not None and before.size == 1
    assert after is not None and after.size >= 2
