"""RecentLatencies (the ratio controller's window of TTFT and token gaps): bounded where requests are added,
whether or not anybody reads it (H3), and still the right quantiles."""

from __future__ import annotations

import tracemalloc

import pytest

from gateway.telemetry.recent import RecentLatencies
from gateway.telemetry.timings import Timings
from loadgen.summary import percentile


def timings(ttft_ms: float, gaps_ms: list[float]) -> Timings:
    return Timings(gateway_queue_ms=0, prefill_queue_ms=0, prefill_ms=0, transfer_ms=0, transfer_bytes=0,
                   decode_queue_ms=0, decode_ms=0, ttft_ms=ttft_ms, e2e_ms=0, token_gaps_ms=gaps_ms)


def test_memory_stays_bounded_with_nobody_reading_the_quantiles() -> None:
    recent = RecentLatencies(window_s=30.0)
    answer = timings(50.0, [20.0] * 500)  # a 500-token answer
    for i in range(200):
        recent.add(answer, now=float(i))  # one a second: the window holds 30 of them
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200, 2200):
            recent.add(answer, now=float(i))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # Kept for all 2000 (the leak): ~30 MB. Bounded: nothing but allocator free lists (~200 KB).
    assert grown < 1024 * 1024, f"{grown} bytes kept for requests that left the window"


def test_a_burst_inside_the_window_is_capped() -> None:
    recent = RecentLatencies(window_s=30.0)
    answer = timings(50.0, [20.0] * 500)
    tracemalloc.start()
    try:
        for _ in range(20_000):
            recent.add(answer, now=1.0)
        kept = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert kept < 4 * 1024 * 1024, f"{kept} bytes kept for one window"


def test_quantiles_from_the_bounded_window() -> None:
    recent = RecentLatencies(window_s=1e9)
    for _ in range(90):
        recent.add(timings(100.0, [10.0] * 300))
    for _ in range(10):
        recent.add(timings(900.0, [50.0] * 300 + [500.0] * 100))
    assert recent.ttft_quantile(0.5) == 0.1
    assert recent.ttft_quantile(0.95) == 0.9
    assert recent.itl_quantile(0.5) == 0.01
    # Of 31000 gaps, 27000 are 10 ms, 3000 are 50 ms and 1000 are 0.5 s: weighted by request length.
    assert recent.itl_quantile(0.85) == 0.01
    assert recent.itl_quantile(0.9) == 0.05
    assert recent.itl_quantile(0.99) == 0.5
    tpot = recent.tpot_quantile(0.95)
    assert tpot is not None and abs(tpot - (300 * 0.05 + 100 * 0.5) / 400) < 1e-9


def test_the_controllers_p90_is_the_benchs_p90() -> None:
    """One definition, numpy's: the ratio controller's TTFT and TPOT p90 over its window are what `pdserve
    bench` reports as the p90 of the same requests (linear between order statistics)."""
    ttfts_s = [0.1 * i for i in range(1, 11)]  # ten requests: the p90 lies between the 9th and the 10th
    tpots_s = [0.01 * i for i in range(1, 11)]
    recent = RecentLatencies(window_s=1e9)
    for ttft, tpot in zip(ttfts_s, tpots_s, strict=True):
        recent.add(timings(1000 * ttft, [1000 * tpot] * 4))
    assert recent.ttft_quantile(0.9) == pytest.approx(percentile(ttfts_s, 90)) == pytest.approx(0.91)
    assert recent.tpot_quantile(0.9) == pytest.approx(percentile(tpots_s, 90)) == pytest.approx(0.091)


def test_the_weighted_itl_quantile_is_the_inverted_cdf() -> None:
    """numpy's weighted quantile: the smallest gap with at least q of the weight at or below it."""
    recent = RecentLatencies(window_s=1e9)
    recent.add(timings(100.0, [10.0] * 8))
    recent.add(timings(100.0, [10.0] * 8))
    recent.add(timings(100.0, [50.0] * 16))  # sampled to 8 gaps, each standing for 2
    # Half the weight (16 of 32 gaps) is at 10 ms: the median is 10 ms, not the next gap up.
    assert recent.itl_quantile(0.5) == 0.01
    assert recent.itl_quantile(0.51) == 0.05


def test_the_settled_attainment_leaves_out_a_changes_own_transients() -> None:
    """Review P8: after a scale-in, the streams it moved and the requests that queued while it applied miss
    the SLO because of the change itself; counted, they made --scale auto add the worker back (a flap)."""
    import time

    recent = RecentLatencies(window_s=1e9)
    changed = time.monotonic()
    time.sleep(0.3)

    def answer(ttft_ms: float, e2e_ms: float, moves: int = 0) -> Timings:
        return timings(ttft_ms, [10.0]).model_copy(update={"e2e_ms": e2e_ms, "num_moves": moves})

    for _ in range(10):
        recent.add(answer(9000.0, 10_000.0))  # arrived 10 s ago: it queued while the change applied
        recent.add(answer(9000.0, 200.0, moves=1))  # a stream the change moved
    for _ in range(19):
        recent.add(answer(100.0, 200.0))  # the fleet as it is now
    assert recent.settled_attainment(5.0, 0.05, changed, min_requests=20) is None  # too few to judge
    recent.add(answer(100.0, 200.0))
    assert recent.settled_attainment(5.0, 0.05, changed, min_requests=20) == 1.0
    assert recent.attainment(5.0, 0.05, since=changed) == pytest.approx(0.5)  # what it counted before
