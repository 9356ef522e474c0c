"""The scale controller's decisions (gateway/ratio/sizing.py): the smallest size that holds the recent traffic
with its headroom; out on a confirmed plan, in one worker at a time after a calm period, never outside the
range nor the per-role bounds; bad settings refused naming the flag.

Pure: the tuner's simulator with known step costs (tests/helpers/tuning.py), synthetic arrivals; no Ray.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.config import ServeConfig
from gateway.ratio.planner import LayoutPlanner
from gateway.ratio.role_bounds import RoleBounds
from gateway.ratio.sizing import (
    ScalePolicy,
    SizePlan,
    Sizer,
    candidate_layouts,
    corrected,
    layouts_of,
    plan_size,
    squeezed,
)
from gateway.telemetry.traffic import Arrival
from loadgen.summary import SLO
from tests.helpers.tuning import poisson_arrivals, profile, sim_config, step_model
from tuner.simulator import Layout

# A decode step costs 30 ms + 1 ms per request in the batch; prompts 2 ms a token. With 300-token answers,
# one worker holds the 50 ms ITL SLO up to about 0.6 req/s, two up to about 1.6.
MODEL = step_model(prefill=(0.01, 0.002, 0.0), decode=(0.03, 0.001, 0.0))
SLO_ = SLO(ttft_s=5.0, itl_s=0.05)
POLICY = ScalePolicy(min_workers=1, max_workers=3, min_dwell_s=5.0, in_calm_s=30.0, out_confirmations=2)


def chat(rate: float, num: int = 120) -> list[Arrival]:
    return poisson_arrivals(64, 300, rate, num, seed=7, end=10_000.0)


def planner(policy: ScalePolicy = POLICY) -> LayoutPlanner:
    return LayoutPlanner(MODEL, sim_config(), SLO_, policy.candidates, policy.min_requests)


def test_the_smallest_size_that_holds_the_traffic_with_headroom_is_planned() -> None:
    light, busy, flood = (plan_size(planner(), chat(rate), POLICY) for rate in (0.3, 2.0, 20.0))
    assert light is not None and (light.size, light.holds) == (1, True)
    assert light.layout == Layout(0, 0, 1)
    assert busy is not None and busy.holds and busy.size >= 2
    assert busy.best_by_size[1].attainment < POLICY.target_attainment  # one worker does not hold it
    assert flood is not None and not flood.holds and flood.size == 3  # none holds: the most it may have
    assert set(flood.best_by_size) == {1, 2, 3}
    summary = busy.summary()
    assert summary["size"] == busy.size and set(summary["sizes"]) == {"1", "2", "3"}  # type: ignore[arg-type]
    assert plan_size(planner(ScalePolicy(1, 3, min_requests=5)), chat(2.0, num=4), POLICY) is None  # too few
    trickle = plan_size(planner(), chat(0.05, num=2), POLICY)  # a trickle is planned: the smallest holds it
    assert trickle is not None and trickle.size == 1
    idle = plan_size(planner(), [], POLICY)  # none at all: the smallest size, all mixed
    assert idle is not None and (idle.size, idle.layout, idle.num_requests) == (1, Layout(0, 0, 1), 0)


def test_the_headroom_replays_the_window_faster() -> None:
    window = chat(1.0, num=10)
    fast = squeezed(window, 2.0)
    assert fast[0].at == window[0].at
    assert fast[-1].at - fast[0].at == pytest.approx((window[-1].at - window[0].at) / 2)
    # A rate one worker holds without headroom needs a second with it (here 0.5 req/s: one worker's
    # attainment 1.0 as it came, 0.18 at twice the rate).
    bare = plan_size(planner(), chat(0.5), ScalePolicy(1, 3, headroom=0.0))
    margin = plan_size(planner(), chat(0.5), ScalePolicy(1, 3, headroom=1.0))
    assert bare is not None and margin is not None and (bare.size, margin.size) == (1, 2)
    assert margin.rate == pytest.approx(bare.rate)  # the rate reported is the traffic's own


def plan(size: int, layout: Layout, plan_for: SizePlan | None = None) -> SizePlan:
    """A plan naming `size` (its best layout `layout`), with the figures of a real one."""
    base = plan_for or plan_size(planner(), chat(2.0), POLICY)
    assert base is not None
    return SizePlan(size, layout, True, base.rate, base.num_requests, base.best_by_size, base.scores)


def test_scale_out_needs_confirmation_then_jumps_and_scale_in_goes_one_at_a_time_after_calm() -> None:
    sizer = Sizer(POLICY)
    two, three = Layout(1, 1, 0), Layout(1, 2, 0)
    busy = plan_size(planner(), chat(2.0), POLICY)
    assert busy is not None
    # Named once: not yet; twice: straight to the size named.
    assert sizer.decide(plan(3, three, busy), Layout(0, 0, 1), now=100.0) is None
    decision = sizer.decide(plan(3, three, busy), Layout(0, 0, 1), now=101.0)
    assert decision is not None and decision.reason == "scale_out"
    assert (decision.from_layout, decision.to_layout) == (Layout(0, 0, 1), three)
    assert decision.prediction["size"] == 3 and "req/s" in decision.detail
    sizer.note_change(110.0)
    # Within the dwell nothing moves; a smaller size named for less than in_calm_s: nothing either.
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), three, now=112.0) is None
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), three, now=130.0) is None
    # A plan that names the current size again restarts the calm period.
    assert sizer.decide(plan(3, three, busy), three, now=135.0) is None
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), three, now=140.0) is None
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), three, now=165.0) is None
    decision = sizer.decide(plan(1, Layout(0, 0, 1), busy), three, now=171.0)
    assert decision is not None and decision.reason == "scale_in"
    assert decision.to_layout.num_workers == 2  # one worker fewer, at that size's best split
    assert decision.to_layout == busy.best_by_size[2].layout
    sizer.note_change(180.0)
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), two, now=200.0) is None  # calm again first
    assert sizer.decide(plan(1, Layout(0, 0, 1), busy), two, now=231.0) is not None


def test_never_below_the_minimum() -> None:
    policy = ScalePolicy(min_workers=2, max_workers=3, min_dwell_s=0.0, in_calm_s=1.0)
    light = plan_size(planner(policy), chat(0.3), policy)
    assert light is not None and light.size == 2  # the smallest size in range holds it
    sizer = Sizer(policy)
    assert sizer.decide(light, light.layout, now=0.0) is None
    assert sizer.decide(light, light.layout, now=10.0) is None  # at the minimum: stays


@pytest.mark.parametrize(("policy", "named"), [
    ({"min_workers": 0, "max_workers": 2}, "--min-workers must be >= 1"),
    ({"min_workers": 4, "max_workers": 2}, "--min-workers 4 is above --max-workers 2"),
])
def test_a_bad_scale_policy_names_the_flag(policy: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ScalePolicy(**policy)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    profile(MODEL, sim_config()).save(path)
    return str(path)


@pytest.mark.parametrize(("flags", "named"), [
    ({"scale": "auto", "max_workers": 3, "min_workers": 4}, "--min-workers 4 is above --max-workers 3"),
    ({"scale": "auto", "profile": "p.json"}, "--scale auto needs --max-workers"),
    ({"scale": "auto", "max_workers": 3}, "--scale auto needs --profile"),
    ({"max_workers": 3}, "--max-workers bounds the scale controller: give --scale auto"),
    ({"scale": "auto", "ratio": "auto", "max_workers": 3}, "--scale auto chooses each worker's role too"),
    ({"scale": "auto", "max_workers": 3, "profile": "p.json", "prefill": 2, "decode": 2},
     "the starting layout has 4 workers, outside --min-workers 1 .. --max-workers 3"),
    ({"scale": "auto", "max_workers": 3, "profile": "p.json", "backend": "torch"},
     "--scale auto moves workers between roles"),
    ({"min_workers": 0}, "min_workers"),
])
def test_bad_scale_settings_are_refused_naming_the_flag(tiny_chat_model_dir: Path, profile_path: str,
                                                         flags: dict[str, object], named: str) -> None:
    flags = {k: profile_path if v == "p.json" else v for k, v in flags.items()}
    with pytest.raises(ValueError, match=named):
        ServeConfig(model=str(tiny_chat_model_dir), **flags)  # type: ignore[arg-type]


def test_good_scale_settings_become_the_planners_range(tiny_chat_model_dir: Path, profile_path: str) -> None:
    from gateway.serve_settings import planner_settings, threads_per_worker

    config = ServeConfig(model=str(tiny_chat_model_dir), scale="auto", min_workers=2, max_workers=4,
                         profile=profile_path)
    assert config.is_auto
    settings = planner_settings(config)
    assert settings is not None and settings.scale == ScalePolicy(2, 4)
    assert list(settings.scale.sizes) == [2, 3, 4]
    # This machine's cores are split over the most workers the fleet may grow to here, not its start.
    assert threads_per_worker(config) == max(1, len(os.sched_getaffinity(0)) // 4)
    quick = ServeConfig(model=str(tiny_chat_model_dir), scale="auto", max_workers=2, profile=profile_path,
                        scale_window_s=12, scale_in_calm_s=5)
    settings = planner_settings(quick)
    assert settings is not None and settings.scale is not None
    assert (settings.scale.min_workers, settings.scale.window_s, settings.scale.in_calm_s,
            settings.scale.interval_s) == (1, 12, 5, 2)


def test_an_idle_fleet_shrinks_one_worker_at_a_time_to_all_mixed() -> None:
    policy = ScalePolicy(min_workers=1, max_workers=3, min_dwell_s=0.0, in_calm_s=10.0)
    idle = plan_size(planner(policy), [], policy)
    assert idle is not None
    sizer = Sizer(policy)
    assert sizer.decide(idle, Layout(1, 2, 0), now=0.0) is None
    decision = sizer.decide(idle, Layout(1, 2, 0), now=10.0)
    assert decision is not None and decision.reason == "scale_in" and decision.to_layout == Layout(0, 0, 2)


def test_measured_attainment_below_target_overrules_an_optimistic_plan() -> None:
    """The plan says one worker holds the traffic; the fleet measures 40% SLO attainment: one worker more,
    never fewer, and a measured figure at target leaves the plan as it was."""
    policy = ScalePolicy(min_workers=1, max_workers=3, min_dwell_s=0.0, in_calm_s=1.0, out_confirmations=2)
    light = plan_size(planner(policy), chat(0.3), policy)
    assert light is not None and light.size == 1
    assert corrected(light, 0.95, Layout(0, 0, 1), policy) is light
    assert corrected(light, None, Layout(0, 0, 1), policy) is light
    more = corrected(light, 0.4, Layout(0, 0, 1), policy)
    assert (more.size, more.holds, more.measured_attainment) == (2, False, 0.4)
    assert more.layout == light.best_by_size[2].layout and more.summary()["measured_attainment"] == 0.4
    sizer = Sizer(policy)
    assert sizer.decide(more, Layout(0, 0, 1), now=0.0) is None
    decision = sizer.decide(more, Layout(0, 0, 1), now=1.0)
    assert decision is not None and decision.reason == "scale_out"
    assert "measured SLO attainment 40%" in decision.detail
    # On two workers still below target: a third; at max_workers it stays (no scale-in either).
    assert corrected(light, 0.4, Layout(0, 0, 2), policy).size == 3
    at_max = corrected(light, 0.4, Layout(0, 0, 3), policy)
    assert at_max.size == 3
    sizer = Sizer(policy)
    assert all(sizer.decide(at_max, Layout(0, 0, 3), now=t) is None for t in (0.0, 5.0, 10.0))


def test_a_measured_scale_out_that_undoes_a_scale_in_waits_longer_and_backs_the_next_scale_in_off() -> None:
    """Review P8: a scale-in, then measured attainment under target (the change's transients, or a plan at
    the boundary) asking for the worker back: the reversal waits reversal_dwells dwells, is named as such, and
    each one doubles the calm before the next scale-in, so the fleet does not flap every minute."""
    policy = ScalePolicy(min_workers=1, max_workers=3, min_dwell_s=10.0, in_calm_s=30.0, out_confirmations=1)
    light = plan_size(planner(policy), chat(0.3), policy)
    assert light is not None
    sizer = Sizer(policy)
    two, one = light.best_by_size[2].layout, light.best_by_size[1].layout
    assert sizer.decide(light, two, now=0.0) is None
    shrink = sizer.decide(light, two, now=30.0)
    assert shrink is not None and shrink.reason == "scale_in"
    sizer.note_change(40.0)
    back = corrected(light, 0.5, one, policy)  # measured under target on one worker: one more
    assert sizer.decide(back, one, now=55.0) is None  # past one dwell, not past three
    reversal = sizer.decide(back, one, now=71.0)
    assert reversal is not None and reversal.reason == "scale_out_reversal"
    assert "60 s of calm" in reversal.detail and sizer.in_calm_s == 60.0
    sizer.note_change(80.0)
    assert sizer.decide(light, two, now=90.0) is None
    assert sizer.decide(light, two, now=140.0) is None  # 50 s of calm: no longer enough
    assert sizer.decide(light, two, now=151.0) is not None  # 61 s


def test_per_role_bounds_keep_every_plan_and_move_within_them() -> None:
    """--max-prefill-workers 1 --min-decode-workers 2 (a mixed worker counts for both roles): the candidates
    are the layouts within them; sizes with none are skipped, out and in alike; a split set by hand outside
    them is moved back into them at the same size."""
    policy = ScalePolicy(min_workers=1, max_workers=4, roles=RoleBounds(max_prefill=1, min_decode=2),
                         min_dwell_s=0.0, in_calm_s=10.0, out_confirmations=1)
    assert policy.sizes == [3, 4]  # 1 or 2 workers cannot hold 1 prefill and 2 decode
    assert policy.candidates == [Layout(1, 2, 0), Layout(1, 3, 0)]
    assert candidate_layouts([3]) == layouts_of(3)  # without bounds: every split
    assert all(policy.roles.allows(layout) for layout in policy.candidates)
    assert not policy.roles.allows(Layout(0, 0, 3)) and not policy.roles.allows(Layout(2, 1, 0))
    idle = plan_size(planner(policy), [], policy)
    assert idle is not None and (idle.size, idle.layout) == (3, Layout(1, 2, 0))
    flood = plan_size(planner(policy), chat(20.0), policy)
    assert flood is not None and set(flood.best_by_size) == {3, 4} and flood.layout == Layout(1, 3, 0)
    assert {s.layout for s in flood.scores} == set(policy.candidates)
    # Out from a layout below the bounds' smallest size; in from 4 stops at 3.
    decision = Sizer(policy).decide(flood, Layout(0, 0, 1), now=0.0)
    assert decision is not None and (decision.reason, decision.to_layout) == ("scale_out", Layout(1, 3, 0))
    sizer = Sizer(policy)
    assert sizer.decide(idle, Layout(1, 3, 0), now=0.0) is None
    decision = sizer.decide(idle, Layout(1, 3, 0), now=10.0)
    assert decision is not None and (decision.reason, decision.to_layout) == ("scale_in", Layout(1, 2, 0))
    assert Sizer(policy).decide(idle, Layout(1, 2, 0), now=100.0) is None  # the smallest allowed: stays
    # 3 mixed, set by hand while the controller was off, is outside: back to 1 prefill + 2 decode.
    decision = Sizer(policy).decide(idle, Layout(0, 0, 3), now=0.0)
    assert decision is not None and (decision.reason, decision.to_layout) == ("rebalance", Layout(1, 2, 0))
    assert "outside --max-prefill-workers 1 --min-decode-workers 2" in decision.detail
    # Measured attainment below target on 3 workers: the next allowed size up.
    assert corrected(idle, 0.4, Layout(1, 2, 0), policy).layout.num_workers == 4


@pytest.mark.parametrize(("bounds", "named"), [
    ({"min_prefill": 3, "max_prefill": 2}, "--min-prefill-workers 3 is above --max-prefill-workers 2"),
    ({"max_decode": 0}, "--max-decode-workers >= 1"),
    ({"min_prefill": 3, "min_decode": 3}, "--min-prefill-workers 3 --min-decode-workers 3: no layout of "
                                          "--min-workers 1 .. --max-workers 2"),
])
def test_per_role_bounds_that_allow_nothing_name_the_flags(bounds: dict[str, int], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        ScalePolicy(1, 2, RoleBounds(**bounds))


def test_per_role_flags_reach_the_policy_or_are_refused(tiny_chat_model_dir: Path, profile_path: str) -> None:
    from gateway.serve_settings import planner_settings

    def serve(**flags: object) -> ServeConfig:
        return ServeConfig(model=str(tiny_chat_model_dir), **flags)  # type: ignore[arg-type]

    config = serve(scale="auto", max_workers=4, profile=profile_path, max_prefill_workers=1,
                   min_decode_workers=1)
    settings = planner_settings(config)
    assert settings is not None and settings.scale is not None
    assert settings.scale.roles == RoleBounds(max_prefill=1, min_decode=1)
    assert Layout(0, 0, 2) not in settings.scale.candidates and Layout(1, 3, 0) in settings.scale.candidates
    with pytest.raises(ValueError, match="--min-prefill-workers and --max-decode-workers bound the scale "
                                         "controller: give --scale auto too"):
        serve(min_prefill_workers=0, max_decode_workers=2)
    with pytest.raises(ValueError, match=r"the starting layout \(--prefill 0 --decode 0 --mixed 2\) is "
                                         "outside --max-prefill-workers 1"):
        serve(scale="auto", max_workers=4, profile=profile_path, mixed=2, max_prefill_workers=1)
    with pytest.raises(ValueError, match="--min-decode-workers 4 is above --max-decode-workers 2"):
        serve(scale="auto", max_workers=4, profile=profile_path, min_decode_workers=4, max_decode_workers=2)
