"""The simulator against answers known without it: queueing theory, hand-computed timelines, overload."""

from __future__ import annotations

import statistics

import pytest

from loadgen.summary import SLO
from loadgen.workload import RequestShape, plan_requests
from tests.helpers.tuning import assert_blocks_whole, sim_config, step_model
from tuner.metrics import score, token_percentile
from tuner.simulator import Layout, Simulation


def test_one_prefill_worker_is_an_md1_queue_with_the_pollaczek_khinchine_mean_wait() -> None:
    service_s, utilization = 0.01, 0.7
    # A budget of one prompt per forward and a constant forward time: deterministic service, one server.
    config = sim_config(budget=16)
    requests = plan_requests(20_000, seed=7, rate=utilization / service_s, input_len=16, output_len=1)
    sim = Simulation(Layout(1, 1), config, step_model(prefill=(service_s, 0.0, 0.0)))

    result = sim.run(requests)

    waits = [ttft - service_s for ttft in result.ttft_s if ttft is not None]
    expected = utilization * service_s / (2 * (1 - utilization))  # Wq of M/D/1
    assert len(waits) == len(requests)
    assert statistics.fmean(waits) == pytest.approx(expected, rel=0.08)
    assert_blocks_whole(sim)


def test_a_decode_batch_of_known_step_time_gives_known_inter_token_latency() -> None:
    batch, num_tokens, step = 8, 40, (0.004, 0.0005, 0.0)  # a decode step: 4 ms + 0.5 ms per request
    transfer_s, prefill_s = 0.003, 0.02
    # All at once: one prefill forward, pulls that end together, one decode batch.
    requests = [RequestShape(i, 0.0, 32, num_tokens) for i in range(batch)]
    sim = Simulation(Layout(1, 1), sim_config(), step_model(prefill=(prefill_s, 0.0, 0.0), decode=step,
                                                            transfer=(transfer_s, 0.0)))

    result = sim.run(requests)

    step_s = step[0] + step[1] * batch
    assert token_percentile(result, 50) == pytest.approx(step_s)
    for ttft, e2e in zip(result.ttft_s, result.e2e_s, strict=True):
        assert ttft == pytest.approx(prefill_s)
        # after the first token: the pull, then one decode step per further token
        assert e2e - ttft == pytest.approx(transfer_s + (num_tokens - 1) * step_s)
    assert_blocks_whole(sim)


def test_a_mixed_worker_prefills_inside_its_own_steps_across_hops() -> None:
    hop_s, prompt = 0.001, 100
    model = step_model(prefill=(0.002, 1e-4, 0.0), decode=(0.003, 0.0, 0.0))
    sim = Simulation(Layout(0, 0, 1), sim_config(hop_s=hop_s), model)

    result = sim.run([RequestShape(0, 0.5, prompt, 5)])

    # gateway → worker, one prefill forward, worker → gateway; then 4 decode steps
    assert result.ttft_s[0] == pytest.approx(2 * hop_s + 0.002 + 1e-4 * prompt)
    assert result.e2e_s[0] == pytest.approx(result.ttft_s[0] + 4 * 0.003)
    assert_blocks_whole(sim)


def test_a_layout_that_cannot_hold_the_rate_shows_growing_queues() -> None:
    service_s = 0.01
    requests = plan_requests(2000, seed=1, rate=2.0 / service_s, input_len=16, output_len=4)
    config = sim_config(budget=16)
    model = step_model(prefill=(service_s, 0.0, 0.0), decode=(0.001, 0.0, 0.0))
    slo = SLO(ttft_s=0.5, itl_s=0.1)

    overloaded = score(Simulation(Layout(1, 1), config, model).run(requests), slo, 200.0)
    enough = score(Simulation(Layout(3, 1), config, model).run(requests), slo, 200.0)

    assert overloaded.backlog_growth > 50  # requests/s: arrivals at 200/s, service at 100/s
    assert overloaded.ttft_p99_s > 5 and not overloaded.holds
    assert abs(enough.backlog_growth) < 1 and enough.holds


def test_short_kv_preempts_and_recomputes_without_losing_tokens_or_blocks() -> None:
    # Admission counts tokens (19 per request, 16 at once) but blocks hold 16: the decode worker overcommits
    # and must preempt when the requests cross into their second block.
    config = sim_config(num_blocks=20, block_size=16)
    requests = [RequestShape(i, 0.0, 9, 10) for i in range(18)]
    sim = Simulation(Layout(1, 1), config, step_model(decode=(0.002, 0.0001, 0.0)))

    result = sim.run(requests)

    assert result.num_preemptions > 0
    assert all(e2e is not None for e2e in result.e2e_s)
    assert sum(result.num_output_tokens) == 18 * 10
    assert_blocks_whole(sim)


def test_a_layout_without_a_decode_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot serve"):
        Simulation(Layout(2, 0), sim_config(), step_model())


def test_a_long_prompt_moves_the_streams_off_its_mixed_worker_as_the_router_does() -> None:
    """Four streams on two mixed workers, then a long prompt: with the router's clearing rule the streams of
    the worker that takes the prompt move (their KV pulled) and no stream waits behind its chunks; without
    it, two streams sit through every chunk. Every request finishes and every block comes back either way."""
    from dataclasses import replace

    model = step_model(prefill=(0.002, 1e-4, 0.0), decode=(0.005, 0.0, 0.0), transfer=(0.001, 0.0))
    requests = [RequestShape(i, 0.0, 64, 200) for i in range(4)] + [RequestShape(4, 0.3, 3000, 4)]
    largest: dict[bool, float] = {}
    for clears in (True, False):
        config = replace(sim_config(hop_s=0.001), move_streams_from_tokens=1024 if clears else 0)
        sim = Simulation(Layout(0, 0, 2), config, model)
        result = sim.run(requests)
        assert all(e2e is not None for e2e in result.e2e_s)
        assert result.num_output_tokens == (200, 200, 200, 200, 4)
        largest[clears] = max([gap for gap, n in result.itl_steps if n] + list(result.itl_gaps))
        assert_blocks_whole(sim)
    # A chunk of 512 prompt tokens is a 0.05 s step; a move costs the moved streams about two 5 ms steps.
    assert largest[False] > 0.05
    assert largest[True] < 0.03
