"""The ratio controller's decisions (Ladder) and the resizer's move planning, without a server."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from gateway.ratio.ladder import ControllerPolicy, Ladder, Signals
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import Move, plan_moves
from worker_runtime.roles import Role

POLICY = ControllerPolicy(interval_s=1.0, min_dwell_s=5.0, calm_s=10.0, long_prompt_tokens=1000,
                          ttft_slo_s=2.0, itl_slo_s=0.2)
QUIET = Signals(level=0, num_workers=2, queued_prompt_tokens=0, num_decoding=4, kv_occupancy=0.1,
                ttft_p90_s=0.5, tpot_p90_s=0.05, itl_p50_s=0.04, longest_pending_prompt=0,
                longest_prompt_beside_streams=0, seconds_since_long_prompt=float("inf"))
BESIDE_STREAMS = dict(seconds_since_long_prompt=0.1, queued_prompt_tokens=1500, longest_pending_prompt=1500,
                      longest_prompt_beside_streams=1500)


def test_a_long_prompt_among_decoding_streams_disaggregates_at_once() -> None:
    ladder = Ladder(POLICY)
    assert ladder.decide(QUIET, now=100.0) is None
    decision = ladder.decide(dataclasses.replace(QUIET, **BESIDE_STREAMS), now=101.0)
    assert decision is not None and (decision.from_level, decision.to_level) == (0, 1)
    assert decision.reason == "long_prompt"


def test_a_long_prompt_still_being_prefilled_disaggregates_once_the_dwell_time_passed() -> None:
    ladder = Ladder(POLICY)
    ladder.note_change(100.0)  # just came back to all mixed
    prefilling = dataclasses.replace(QUIET, **{**BESIDE_STREAMS, "seconds_since_long_prompt": 3.0})
    assert ladder.decide(prefilling, now=103.0) is None
    decision = ladder.decide(prefilling, now=105.5)
    assert decision is not None and decision.reason == "long_prompt"
    # Many short prompts are not a long one, however many tokens they add up to.
    assert Ladder(POLICY).decide(dataclasses.replace(QUIET, longest_pending_prompt=256,
                                                     queued_prompt_tokens=4096), now=200.0) is None


def test_a_long_prompt_on_a_worker_with_nothing_else_to_decode_changes_nothing() -> None:
    # Light traffic: the prompt went to the worker that decodes nothing; the other one's streams run on.
    signals = dataclasses.replace(QUIET, **{**BESIDE_STREAMS, "longest_prompt_beside_streams": 0})
    assert Ladder(POLICY).decide(signals, now=100.0) is None
    nothing_decoding = dataclasses.replace(signals, num_decoding=0)
    assert Ladder(POLICY).decide(nothing_decoding, now=100.0) is None


def test_tpot_over_the_itl_slo_while_prompts_queue_disaggregates() -> None:
    slow = dataclasses.replace(QUIET, tpot_p90_s=0.5, queued_prompt_tokens=300)
    decision = Ladder(POLICY).decide(slow, now=100.0)
    assert decision is not None and decision.reason == "itl_slo" and decision.to_level == 1
    # Slow decoding with no prompt work, or slow decoding all the time (the median over the SLO too: short of
    # decoding cores), is not something a prefill worker would fix.
    assert Ladder(POLICY).decide(dataclasses.replace(slow, queued_prompt_tokens=0), now=100.0) is None
    assert Ladder(POLICY).decide(dataclasses.replace(slow, itl_p50_s=0.3), now=100.0) is None


def test_no_change_within_the_dwell_time_of_the_last() -> None:
    ladder = Ladder(POLICY)
    ladder.note_change(100.0)
    urgent = dataclasses.replace(QUIET, **BESIDE_STREAMS)
    assert ladder.decide(urgent, now=104.0) is None
    assert ladder.decide(urgent, now=105.5) is not None


def test_back_to_mixed_only_after_prefill_was_calm_for_calm_s() -> None:
    ladder = Ladder(POLICY)
    ladder.note_change(0.0)
    disaggregated = dataclasses.replace(QUIET, level=1)
    assert ladder.decide(disaggregated, now=10.0) is None  # calm starts here
    busy_again = dataclasses.replace(disaggregated, queued_prompt_tokens=800)
    assert ladder.decide(busy_again, now=15.0) is None  # above the low mark: the calm timer restarts
    assert ladder.decide(disaggregated, now=16.0) is None
    assert ladder.decide(disaggregated, now=25.0) is None
    decision = ladder.decide(disaggregated, now=26.5)
    assert decision is not None and (decision.to_level, decision.reason) == (0, "prefill_idle")


def test_ttft_over_its_slo_with_prompt_work_piling_up_adds_a_prefill_worker() -> None:
    piled = dataclasses.replace(QUIET, level=1, num_workers=4, ttft_p90_s=3.0, queued_prompt_tokens=2500)
    decision = Ladder(POLICY).decide(piled, now=100.0)
    assert decision is not None and (decision.to_level, decision.reason) == (2, "ttft_slo")
    # Never the last decode worker.
    assert Ladder(POLICY).decide(dataclasses.replace(piled, level=3), now=100.0) is None


def test_bad_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        ControllerPolicy(itl_slo_s=0)
    with pytest.raises(ValueError, match="long_prompt_tokens"):
        ControllerPolicy(long_prompt_tokens=0)


def test_plans_change_roles_before_adding_or_removing_workers() -> None:
    one_one = {Role.PREFILL: 1, Role.DECODE: 1, Role.MIXED: 0}
    two_mixed = {Role.PREFILL: 0, Role.DECODE: 0, Role.MIXED: 2}
    assert plan_moves(one_one, two_mixed) == [Move("change", Role.MIXED, Role.DECODE),
                                              Move("change", Role.MIXED, Role.PREFILL)]
    assert plan_moves(two_mixed, one_one) == [Move("change", Role.DECODE, Role.MIXED),
                                              Move("change", Role.PREFILL, Role.MIXED)]
    # Adds come before a change that takes a worker out of service, and drains come last.
    assert plan_moves(one_one, {Role.PREFILL: 0, Role.DECODE: 1, Role.MIXED: 2}) == [
        Move("add", Role.MIXED), Move("change", Role.MIXED, Role.PREFILL)]
    one_two = {Role.PREFILL: 1, Role.DECODE: 2, Role.MIXED: 0}
    assert plan_moves(one_two, one_one) == [Move("drain", Role.DECODE)]
    assert plan_moves(one_one, one_one) == []


def test_a_pools_body_is_a_layout_or_auto() -> None:
    assert PoolLayout.model_validate({"mixed": 2}).by_role() == {Role.PREFILL: 0, Role.DECODE: 0,
                                                                  Role.MIXED: 2}
    assert PoolLayout.model_validate({"auto": True}).auto is True
    with pytest.raises(ValidationError, match="not both"):
        PoolLayout.model_validate({"auto": True, "prefill": 1})
    with pytest.raises(ValidationError, match="worker counts"):
        PoolLayout.model_validate({"drain_grace_s": 3})
    assert PoolLayout.model_validate({"decode": 2, "placement_wait_s": 30}).placement_wait_s == 30
    with pytest.raises(ValidationError, match="not both"):
        PoolLayout.model_validate({"auto": True, "placement_wait_s": 30})
    with pytest.raises(ValidationError, match="placement_wait_s"):
        PoolLayout.model_validate({"decode": 2, "placement_wait_s": 0})


def test_a_move_for_the_itl_slo_that_does_not_help_is_undone_and_not_retried_for_a_while() -> None:
    ladder = Ladder(POLICY)
    slow = dataclasses.replace(QUIET, tpot_p90_s=0.25, queued_prompt_tokens=300)
    decision = ladder.decide(slow, now=100.0)
    assert decision is not None and decision.reason == "itl_slo"
    ladder.note_change(100.0, decision)
    ladder.note_change(101.0)  # the change ended
    still_slow = dataclasses.replace(slow, level=1, tpot_p90_s=0.24)  # 4% better: no real gain
    assert ladder.decide(still_slow, now=105.0) is None  # judged only calm_s after the change
    undo = ladder.decide(still_slow, now=111.5)
    assert undo is not None and (undo.to_level, undo.reason) == (0, "no_gain")
    ladder.note_change(111.5, undo)
    ladder.note_change(112.0)
    assert ladder.decide(slow, now=150.0) is None  # the ITL rule is off for 10 calm periods
    assert ladder.decide(slow, now=213.0) is not None


def test_a_move_for_the_itl_slo_that_helps_stays() -> None:
    ladder = Ladder(POLICY)
    slow = dataclasses.replace(QUIET, tpot_p90_s=0.25, queued_prompt_tokens=2000)
    decision = ladder.decide(slow, now=100.0)
    assert decision is not None
    ladder.note_change(100.0, decision)
    better = dataclasses.replace(slow, level=1, tpot_p90_s=0.12)
    assert ladder.decide(better, now=111.0) is None
    assert ladder.decide(better, now=130.0) is None  # judged once; prompts still queue, so no calm either
