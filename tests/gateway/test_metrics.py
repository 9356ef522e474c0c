"""Gateway metrics: series follow the live workers (review L6); the admission line is in
num_requests_waiting, current at every change (not only when this process answers a scrape); vLLM's
per-request series that pdserve added (longest choice, n, max_tokens, inference time) and the workers' tokens
per step."""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from gateway.requests.admission import Admission
from gateway.telemetry.fleet_metrics import FleetStatus
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.timings import Timings
from llm_engine.step_timeline import STEP_TOKEN_BUCKETS, StepRecord, StepTimeline
from worker_runtime.load import StepTokens, WorkerLoad


def load(worker_id: str, role: str, running: int) -> WorkerLoad:
    return WorkerLoad(worker_id, role, num_waiting=0, num_queued_prompt_tokens=0, num_running=running,
                      num_transferring=0, num_free_blocks=90, num_total_blocks=100, num_outstanding_tokens=0)


def running_series(metrics: Metrics, loads: list[WorkerLoad]) -> dict[tuple[str, str], float]:
    text = metrics.render(FleetStatus(loads=loads)).decode()
    series = {}
    for line in text.splitlines():
        if line.startswith("pdserve:num_requests_running{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            series[(labels["worker"].strip('"'), labels["role"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return series


def test_a_worker_that_changes_role_or_leaves_takes_its_old_series_with_it() -> None:
    metrics = Metrics("m")
    loads = [load("w0", "prefill", 2), load("w1", "decode", 3)]
    assert running_series(metrics, loads) == {("w0", "prefill"): 2, ("w1", "decode"): 3}
    # w0 changed role, w1 left
    assert running_series(metrics, [load("w0", "mixed", 1)]) == {("w0", "mixed"): 1}


def samples(metrics: Metrics, loads: list[WorkerLoad]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = metrics.render(FleetStatus(loads=loads)).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def waiting(scraped: dict[tuple[str, frozenset[tuple[str, str]]], float], worker: str, role: str) -> float:
    return scraped[("pdserve:num_requests_waiting",
                    frozenset({"model_name": "m", "worker": worker, "role": role}.items()))]


def test_the_admission_line_is_a_row_of_num_requests_waiting() -> None:
    metrics = Metrics("m")
    admission = Admission(capacity_tokens=100, max_waiting=4, timeout_s=30, max_waiting_tokens=200)
    admission.on_change.append(lambda: metrics.observe_admission(admission.num_waiting,
                                                                 admission.reserved_tokens))
    workers = [load("w1", "decode", 3)]

    async def scenario() -> None:
        held = await admission.acquire(100)
        queued = [asyncio.create_task(admission.acquire(60)) for _ in range(2)]
        await asyncio.sleep(0)
        scraped = samples(metrics, workers)
        # The line's two requests, beside each worker's own queue; the gauge the route no longer sets.
        assert waiting(scraped, "gateway", "gateway") == 2 and waiting(scraped, "w1", "decode") == 0
        assert scraped[("pdserve:admission_waiting_requests", frozenset({"model_name": "m"}.items()))] == 2
        assert scraped[("pdserve:admission_reserved_tokens", frozenset({"model_name": "m"}.items()))] == 100
        held.release()
        first = await queued[0]
        assert waiting(samples(metrics, workers), "gateway", "gateway") == 1
        first.release()
        (await queued[1]).release()
        assert waiting(samples(metrics, workers), "gateway", "gateway") == 0

    asyncio.run(scenario())


def test_vllms_request_shape_series() -> None:
    metrics = Metrics("m", max_model_len=1000)
    timings = Timings(gateway_queue_ms=0, prefill_queue_ms=0, prefill_ms=40, transfer_ms=5, transfer_bytes=0,
                      decode_queue_ms=0, decode_ms=800, ttft_ms=50, e2e_ms=900, token_gaps_ms=[20.0] * 9)
    metrics.observe_request(timings, "length", num_prompt=7, num_output=30, n=3, max_tokens=10,
                            num_longest_output=10)
    scraped = samples(metrics, [])
    model = frozenset({"model_name": "m"}.items())
    assert scraped[("pdserve:request_generation_tokens_sum", model)] == 30  # every choice's tokens
    assert scraped[("pdserve:request_max_num_generation_tokens_sum", model)] == 10  # the longest choice's
    assert scraped[("pdserve:request_params_n_sum", model)] == 3
    assert scraped[("pdserve:request_params_max_tokens_sum", model)] == 10
    assert abs(scraped[("pdserve:request_inference_time_seconds_sum", model)] - 0.84) < 1e-9


def test_tokens_per_step_are_each_workers_histogram() -> None:
    timeline = StepTimeline()
    for num_decode, num_prefill in ((4, 0), (1, 60), (0, 500)):
        timeline.record(StepRecord(0.0, 1.0, num_decode, num_prefill))
    counts = timeline.tokens
    step_tokens = StepTokens(STEP_TOKEN_BUCKETS, counts.bucket_counts, counts.num_tokens, counts.num_steps)
    worker = dataclasses.replace(load("w0", "mixed", 1), step_tokens=step_tokens)
    scraped = samples(Metrics("m"), [worker])
    labels = {"model_name": "m", "worker": "w0", "role": "mixed"}

    def bucket(le: str) -> float:
        return scraped[("pdserve:iteration_tokens_total_bucket", frozenset({**labels, "le": le}.items()))]

    assert (bucket("1.0"), bucket("8.0"), bucket("64.0"), bucket("512.0"), bucket("+Inf")) == (0, 1, 2, 3, 3)
    assert scraped[("pdserve:iteration_tokens_total_sum", frozenset(labels.items()))] == 565
    assert scraped[("pdserve:iteration_tokens_total_count", frozenset(labels.items()))] == 3
