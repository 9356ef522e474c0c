"""Deadlines (M8): the wait in the admission line is not charged to the prefill stage."""

from __future__ import annotations

from gateway.requests.deadlines import DeadlinePolicy


def test_a_request_admitted_late_gets_its_whole_prefill_budget() -> None:
    policy = DeadlinePolicy(slack_s=60.0, prefill_s_per_token=0.02, decode_s_per_token=1.0)
    on_arrival = policy.for_request(1000.0, 500, 100)
    late = policy.for_request(1000.0, 500, 100, admitted=1059.0)  # 59 s in the line (queue_timeout_s: 60)
    assert late.arrival == 1000.0
    assert late.prefill_by - 1059.0 == on_arrival.prefill_by - 1000.0 == 60.0 + 500 * 0.02
    assert late.finish_by - late.prefill_by == on_arrival.finish_by - on_arrival.prefill_by


def test_admission_before_arrival_counts_from_arrival() -> None:
    policy = DeadlinePolicy()
    assert policy.for_request(1000.0, 10, 10, admitted=999.0) == policy.for_request(1000.0, 10, 10)
