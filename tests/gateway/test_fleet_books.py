"""The pieces behind --api-server-count that need no server: the fleet's sums of the frontends' reports, and a
worker ending the output channels of a gateway that is gone."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass

import pytest

from gateway.control import reported_books
from gateway.control.messages import FrontendReport, frontend_id, frontend_prefix
from gateway.control.plane import kv_tokens_by_worker
from gateway.control.reported_books import ReportedBooks
from gateway.requests.router import LocalPrefillPolicy
from worker_runtime.load import WorkerLoad
from worker_runtime.output_channels import OutputChannels
from worker_runtime.roles import Role


def report(frontend_id: str, in_flight: dict[str, int], prefill: dict[str, int], longest: int
           ) -> FrontendReport:
    return FrontendReport(frontend_id, in_flight, prefill, {}, longest, 0)


def test_books_sum_the_live_frontends_and_forget_a_silent_one(monkeypatch: pytest.MonkeyPatch) -> None:
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: None)
    books.report(report("frontend-a", {"w0": 100}, {"w0": 40}, 0))
    books.report(report("frontend-b", {"w0": 5, "w1": 7}, {"w0": 2}, 1500))
    assert books.in_flight("w0") == 105 and books.in_flight("w1") == 7 and books.in_flight("w2") == 0
    assert books.prefill_tokens["w0"] == 42 and books.longest_local_prefill() == 1500
    books.report(report("frontend-a", {}, {}, 0))  # a newer report replaces the older
    assert books.in_flight("w0") == 5
    monkeypatch.setattr(reported_books, "FRONTEND_SILENT_S", 0.05)
    time.sleep(0.1)
    books.report(report("frontend-a", {}, {}, 0))
    assert books.expire() == ["frontend-b"]
    assert books.in_flight("w1") == 0 and books.frontends() == ["frontend-a"]


def test_a_heartbeat_keeps_a_frontend_whose_reports_stall_and_one_taken_for_dead_is_told(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Review N1: a frontend's event loop may be busy for seconds (its reports stall), while its heartbeat
    thread goes on: it is not taken for dead. One silent in both ways is; its next heartbeat learns so."""
    monkeypatch.setattr(reported_books, "FRONTEND_SILENT_S", 0.05)
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: None)
    assert books.heard("frontend-a") is False  # new to the fleet
    books.report(report("frontend-a", {"w0": 3}, {}, 0))
    books.report(report("frontend-b", {"w0": 4}, {}, 0))
    for _ in range(4):  # a's loop is stuck: no report, only heartbeats
        time.sleep(0.03)
        assert books.heard("frontend-a") is True
        books.expire()
    assert books.frontends() == ["frontend-a"] and books.in_flight("w0") == 3  # b expired, a kept
    assert books.heard("frontend-b") is False  # b wakes up: the fleet had taken it for dead


def test_a_fleet_paused_past_the_lease_expires_no_frontend_on_waking(monkeypatch: pytest.MonkeyPatch) -> None:
    """Review P9: the fleet actor paused longer than FRONTEND_SILENT_S finds every frontend silent when it
    wakes, its heartbeats still queued: it expires none, and counts each one's silence from then on."""
    monkeypatch.setattr(reported_books, "FRONTEND_SILENT_S", 0.05)
    monkeypatch.setattr(reported_books, "FLEET_STALL_S", 0.2)
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: None)
    books.report(report("frontend-a", {"w0": 3}, {}, 0))
    books.report(report("frontend-b", {"w0": 4}, {}, 0))
    assert books.expire() == []
    time.sleep(0.3)  # the fleet paused: no expiry pass, no heartbeat handled
    assert books.expire() == [] and books.in_flight("w0") == 7
    books.heard("frontend-a")  # a's queued heartbeat; b is really gone
    time.sleep(0.04)
    books.heard("frontend-a")
    time.sleep(0.04)
    assert books.expire() == ["frontend-b"] and books.frontends() == ["frontend-a"]


def test_admission_is_one_book_leased_by_demand_across_frontends() -> None:
    """Review N4: the capacity was split evenly per frontend, so one whose clients' connections pinned their
    requests to it answered 429 while the other's half sat idle. The fleet leases each frontend its share
    with every report: what it holds stays its own, the rest goes to whoever waits."""
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: None)
    total, floor = 65536, 8192
    books.report(dataclasses.replace(report("frontend-a", {}, {}, 0), reserved_tokens=32768,
                                     waiting_tokens=8192))
    books.report(report("frontend-b", {}, {}, 0))  # idle: nothing held, nothing waiting
    assert books.admission_share("frontend-a", total, floor) == 65536  # everything free goes to a
    assert books.admission_share("frontend-b", total, floor) == floor  # b keeps one request's worth
    books.report(dataclasses.replace(report("frontend-b", {}, {}, 0), reserved_tokens=8192,
                                     waiting_tokens=24576))
    # Both wait: the free 24576 split 1:3 by what each waits for, on top of what each holds.
    assert books.admission_share("frontend-a", total, floor) == 32768 + 6144
    assert books.admission_share("frontend-b", total, floor) == 8192 + 18432


def test_setting_the_policy_tells_the_fleet_only_when_it_changes() -> None:
    told = []
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: told.append(1))
    books.local_prefill = LocalPrefillPolicy()
    assert told == []
    books.local_prefill = LocalPrefillPolicy(min_prefill_queue_tokens=1024, queue_rule_below_tokens=1024)
    assert told == [1] and books.local_prefill.min_prefill_queue_tokens == 1024


@dataclass(frozen=True)
class Output:
    request_id: str


def test_closing_a_gone_gateways_channels_aborts_its_requests_and_ends_its_stream() -> None:
    async def scenario() -> tuple[list[str], list[int], bool]:
        aborted: list[str] = []
        channels = OutputChannels(abort=aborted.append, is_final=lambda output: False)
        for request_id, channel_id in (("a1", "frontend-a-w0-0"), ("a2", "frontend-a-w0-0"),
                                       ("b1", "frontend-b-w0-0")):
            channels.subscribe(request_id, channel_id)
        batches: list[tuple[str, int, bool]] = []

        async def read(channel_id: str) -> None:
            async for batch in channels.stream(channel_id):
                batches.append((channel_id[:10], len(batch.outputs), batch.closed_by_fleet))

        reader_a = asyncio.create_task(read("frontend-a-w0-0"))
        reader_b = asyncio.create_task(read("frontend-b-w0-0"))
        await asyncio.sleep(0)
        assert channels.close_channels("frontend-a-") == 1
        await asyncio.wait_for(reader_a, 1)  # its parked stream returned
        channels.collect(Output("b1"))
        channels.flush()
        await asyncio.sleep(0.01)
        still_open = not reader_b.done()
        reader_b.cancel()
        return aborted, batches, still_open

    aborted, batches, other_stream_open = asyncio.run(scenario())
    assert sorted(aborted) == ["a1", "a2", "b1"]  # b1 only once its own stream was cancelled at the end
    # The closed stream's last item says so (its reader must not take the worker for dead: review N1).
    assert batches == [("frontend-a", 0, True), ("frontend-b", 1, False)] and other_stream_open


def test_a_frontend_whose_process_exited_is_forgotten_at_once_and_only_it() -> None:
    books = ReportedBooks(LocalPrefillPolicy(), on_policy=lambda: None)
    exited, sibling = frontend_id("node-a", 41), frontend_id("node-a", 412)
    elsewhere = frontend_id("node-b", 41)
    for frontend in (exited, sibling, elsewhere):
        books.report(report(frontend, {"w0": 5}, {}, 0))
    assert books.forget([frontend_prefix("node-a", 41)]) == [exited]  # not pid 412, not node-b's pid 41
    assert sorted(books.frontends()) == sorted([sibling, elsewhere]) and books.in_flight("w0") == 10
    assert books.heard(exited) is False  # a report it still sends finds it new: it joins again


def test_admission_capacity_is_read_off_each_decoding_workers_latest_load() -> None:
    """A decode worker replaced at another tensor-parallel degree holds another number of blocks: the share
    the fleet leases counts what each holds now, not the size read at start (review LOW: admission after a
    degree change). With no decoding worker live, the prefill workers' (same engine settings) stand in."""
    def load(worker_id: str, role: Role, blocks: int) -> WorkerLoad:
        return WorkerLoad(worker_id, role, 0, 0, 0, 0, blocks, blocks, 0)

    loads = [load("p0", Role.PREFILL, 64), load("d0", Role.DECODE, 128), load("m0", Role.MIXED, 32)]
    assert kv_tokens_by_worker(loads, block_size=16, watermark=0.25) == {"d0": 1536, "m0": 384}
    assert kv_tokens_by_worker(loads[:1], block_size=16, watermark=0.0) == {"p0": 1024}
