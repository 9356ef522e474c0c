"""Worker failure handling in one process (no Ray): a step loop that dies answers every request with an
error; handles nobody will pull are released at once; a blocked worker neither spins nor re-hashes; load()
is safe from another thread while the loop runs."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from decode_pool.messages import DecodeOutput, DecodeRequest
from gateway.requests.events import StreamEvent
from gateway.requests.stage_timings import token_times
from kv_transfer import IncompatibleLayoutError, KVHandle
from llm_engine import SamplingParams
from pool_worker.api import WorkerFailed
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.worker import PrefillWorker
from tests.helpers.engines import make_pair
from tests.helpers.reference import hf_greedy, random_prompts
from worker_runtime.step_loop import StepLoop

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def broken_forward(batch: Any) -> Any:
    raise RuntimeError("injected fault: the forward failed")


def prefill_all(prefill: PrefillWorker, prompts: list[list[int]]) -> list[PrefillResult]:
    results: list[PrefillResult] = []
    for index, prompt in enumerate(prompts):
        prefill.submit(PrefillRequest(f"r{index}", tuple(prompt), GREEDY), results.append)
    while len(results) < len(prompts):
        prefill.step()
    return sorted(results, key=lambda r: r.request_id)


def decode_request(result: PrefillResult, prompt: list[int]) -> DecodeRequest:
    return DecodeRequest(result.request_id, tuple(prompt), GREEDY, result.first_token_id,
                         result.first_logprob, result.kv_handle)


def test_prefill_step_loop_that_dies_answers_every_request_with_an_error(tiny_llama_dir: Path) -> None:
    prefill, _ = make_pair(tiny_llama_dir)
    prefill.engine.runner.execute = broken_forward  # type: ignore[method-assign]
    results: list[PrefillResult] = []
    done = threading.Event()

    def on_result(result: PrefillResult) -> None:
        results.append(result)
        if len(results) == 3:
            done.set()

    for index, prompt in enumerate(random_prompts([10, 20, 30], 1000)):
        prefill.submit(PrefillRequest(f"r{index}", tuple(prompt), GREEDY), on_result)
    loop = StepLoop("prefill-test", prefill.step, on_error=prefill.fail)
    loop.start()
    assert done.wait(30)
    loop.stop()
    assert sorted(r.request_id for r in results) == ["r0", "r1", "r2"]
    assert all(r.finish_reason == "error" and "injected fault" in r.error for r in results)
    assert prefill.load().failure
    with pytest.raises(WorkerFailed):
        prefill.submit(PrefillRequest("late", (1, 2, 3), GREEDY), on_result)


def test_decode_step_loop_that_dies_answers_every_request_and_releases_unpulled_kv(
        tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    released: list[int] = []
    decode.release_source = lambda handle, why: released.append(handle.transfer_id)
    prompts = random_prompts([12, 24], 1000)
    results = prefill_all(prefill, prompts)
    outputs: list[DecodeOutput] = []
    for result, prompt in zip(results, prompts, strict=True):
        decode.submit(decode_request(result, prompt), outputs.append)
    decode.engine.runner.execute = broken_forward  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(100):
            decode.step()
    decode.fail(RuntimeError("injected fault: the forward failed"))
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [("r0", "error"), ("r1", "error")]
    assert all("injected fault" in o.error for o in outputs)
    assert decode.load().failure
    with pytest.raises(WorkerFailed):
        decode.submit(decode_request(results[0], prompts[0]), outputs.append)


def test_handles_nobody_will_pull_are_released_at_once(tiny_llama_dir: Path) -> None:
    # Decode KV for one prompt only: the second request waits for blocks, then is aborted there.
    prefill, decode = make_pair(tiny_llama_dir, decode_blocks=6, lease_s=3600)
    decode.release_source = lambda handle, why: prefill.release_kv(handle.transfer_id, why)
    prompts = random_prompts([60, 60], 1000)
    results = prefill_all(prefill, prompts)
    outputs: list[DecodeOutput] = []
    for result, prompt in zip(results, prompts, strict=True):
        decode.submit(decode_request(result, prompt), outputs.append)
    decode.step()
    assert decode.load().num_waiting == 1  # r1 awaits blocks; its prefill blocks are still leased
    decode.abort("r1")
    decode.step()
    prefill.step()
    # r1's lease (an hour long) ended now; r0's blocks went back when its pull finished.
    assert prefill.engine.block_pool.is_whole()
    assert [o.finish_reason for o in outputs if o.request_id == "r1"] == ["abort"]


def test_failed_pull_is_recomputed_and_its_source_released(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir, lease_s=3600)
    decode.release_source = lambda handle, why: prefill.release_kv(handle.transfer_id, why)
    decode.receiver._start = lambda pull, peer: pull.fail("injected: dropped")  # type: ignore[method-assign]
    [prompt] = random_prompts([40], 1000)
    [result] = prefill_all(prefill, [prompt])
    tokens = [result.first_token_id]
    finished: list[DecodeOutput] = []

    def on_output(output: DecodeOutput) -> None:
        tokens.extend(output.token_ids)
        if output.finish_reason:
            finished.append(output)

    decode.submit(decode_request(result, prompt), on_output)
    while not finished:
        decode.step()
    prefill.step()
    assert tokens == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]
    assert finished[0].transfer_bytes == 0
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def test_migrated_request_continues_after_the_tokens_the_client_has(tiny_llama_dir: Path) -> None:
    _, decode = make_pair(tiny_llama_dir)
    [prompt] = random_prompts([30], 1000)
    expected = hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]
    tokens: list[int] = []
    finished: list[DecodeOutput] = []

    def on_output(output: DecodeOutput) -> None:
        tokens.extend(output.token_ids)
        if output.finish_reason:
            finished.append(output)

    migrated = DecodeRequest("m", tuple(prompt), GREEDY, generated_token_ids=tuple(expected[:3]))
    decode.submit(migrated, on_output)
    while not finished:
        decode.step()
    assert tokens == expected[3:]
    assert decode.engine.block_pool.is_whole()


def test_blocked_prefill_worker_sleeps_and_does_not_rehash(tiny_llama_dir: Path) -> None:
    prefill, _ = make_pair(tiny_llama_dir, lease_s=3600, prefill_blocks=12)
    num_blocks = prefill.engine.block_pool.num_blocks
    block_size = prefill.engine.config.block_size
    # The first prompt's KV stays leased (nobody pulls it) and leaves too few blocks for the second.
    big = (num_blocks - 2) * block_size
    [first, second] = random_prompts([big, 4 * block_size], 1000)
    results: list[PrefillResult] = []
    prefill.submit(PrefillRequest("a", tuple(first), GREEDY), results.append)
    while not results:
        prefill.step()
    prefill.submit(PrefillRequest("b", tuple(second), GREEDY), results.append)
    calls = {"schedule": 0}
    schedule = prefill.engine.scheduler._schedule

    def counted() -> Any:
        calls["schedule"] += 1
        return schedule()

    prefill.engine.scheduler._schedule = counted  # type: ignore[method-assign]
    waits = [prefill.step() for _ in range(50)]
    assert all(w is not None and w > 0 for w in waits)  # it sleeps between polls of its leases
    assert calls["schedule"] == 1  # and looks at the blocked prompt once, not every poll
    handle = results[0].kv_handle
    assert isinstance(handle, KVHandle)
    prefill.release_kv(handle.transfer_id, "test: nobody will pull")
    while len(results) < 2:
        prefill.step()
    assert results[1].request_id == "b" and results[1].finish_reason is None


def test_load_is_safe_to_read_while_the_loop_runs(tiny_llama_dir: Path) -> None:
    _, decode = make_pair(tiny_llama_dir)
    done = threading.Event()
    finished: list[str] = []

    def on_output(output: DecodeOutput) -> None:
        if output.finish_reason:
            finished.append(output.request_id)
            if len(finished) == 16:
                done.set()

    loop = StepLoop("decode-test", decode.step, on_error=decode.fail)
    loop.start()
    for index, prompt in enumerate(random_prompts([8] * 16, 1000)):
        decode.submit(DecodeRequest(f"r{index}", tuple(prompt), SamplingParams(max_tokens=20)), on_output)
        loop.wake()
    num_reads = 0
    while not done.wait(0.0005):
        load = decode.load()  # used to iterate the scheduler's deque while the loop thread mutated it
        assert load.num_free_blocks <= load.num_total_blocks
        num_reads += 1
    loop.stop()
    assert loop.error is None and num_reads > 0


def test_a_peer_with_another_layout_is_refused_to_the_caller_and_the_worker_serves_on(
        tiny_llama_dir: Path) -> None:
    """Review N8: adding a peer whose KV blocks mean other bytes raised on the step thread and killed the
    decode worker (and every replacement, wired to the same peer). It is refused to the caller now; a
    transfer-library error while adding one is logged; the step loop lives on either way."""
    prefill, decode = make_pair(tiny_llama_dir)
    peer = prefill.sender.peer_info()
    odd = dataclasses.replace(peer, worker_id="p-odd", layout=dataclasses.replace(peer.layout, block_size=32))
    with pytest.raises(IncompatibleLayoutError, match="block_size"):
        decode.add_peer(odd)

    def broken_add(peer: Any) -> None:
        raise RuntimeError("injected fault: loadRemoteMD failed")

    decode.receiver.add_peer = broken_add  # type: ignore[method-assign]
    decode.add_peer(dataclasses.replace(peer, worker_id="p-broken"))
    prompt = random_prompts([12], 1000)[0]
    [result] = prefill_all(prefill, [prompt])
    outputs: list[DecodeOutput] = []
    decode.submit(decode_request(result, prompt), outputs.append)
    while not outputs or outputs[-1].finish_reason is None:
        decode.step()  # the posted add ran here, raised, and was logged
    assert decode.failure == "" and "p-broken" not in decode.receiver.peers
    tokens = [result.first_token_id] + [t for o in outputs for t in o.token_ids]
    assert tokens == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]


def test_each_token_of_a_merged_event_gets_its_own_time() -> None:
    event = StreamEvent("r", (1, 2, 3), (), (10.0, 10.5, 11.0))
    assert token_times(event, received=100.0) == [99.0, 99.5, 100.0]
    assert token_times(StreamEvent("r", (4, 5), (), ()), received=7.0) == [7.0, 7.0]
    assert token_times(StreamEvent("r", (), (), ()), received=7.0) == []


def test_a_prompt_resubmitted_while_its_kv_is_offered_is_prefilled_again(tiny_llama_dir: Path) -> None:
    """A prefill worker offers a prompt's KV under a lease; the same id submitted again while that lease is
    out (a frontend resuming, a retry) gets its own blocks: the step loop does not die on "already holds
    blocks", and both leases' blocks come back."""
    prefill, decode = make_pair(tiny_llama_dir)
    prompt = random_prompts([40], 1000, seed=2)[0]
    first = prefill_all(prefill, [prompt])[0]
    assert first.kv_handle is not None
    again = prefill_all(prefill, [prompt])[0]
    assert not prefill.failure and again.kv_handle is not None
    assert again.first_token_id == first.first_token_id
    prefill.release_kv(first.kv_handle.transfer_id, "test")
    prefill.release_kv(again.kv_handle.transfer_id, "test")
    prefill.step()
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()


def running_decode(tiny_llama_dir: Path, prompts: list[list[int]], sampling: SamplingParams = GREEDY
                   ) -> tuple[Any, list[DecodeOutput]]:
    """A decode worker (prefilling its own prompts) with these requests in its batch, one token each."""
    _, decode = make_pair(tiny_llama_dir)
    outputs: list[DecodeOutput] = []
    for index, prompt in enumerate(prompts):
        decode.submit(DecodeRequest(f"r{index}", tuple(prompt), sampling), outputs.append)
    while len({o.request_id for o in outputs}) < len(prompts):
        decode.step()
    return decode, outputs


@pytest.mark.parametrize("error, is_blamed", [
    (RuntimeError("injected fault: the forward failed"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"), False),
])
def test_a_failed_step_blames_its_batch_only_when_the_worker_is_not_at_fault(
        tiny_llama_dir: Path, error: BaseException, is_blamed: bool) -> None:
    """Issue 48, defect 3: the batch of a step that raised becomes one group of suspects (the step named,
    with its size), unless the worker's own fault broke it (an allocator OOM, a dead rank's collective)."""
    decode, outputs = running_decode(tiny_llama_dir, random_prompts([10, 14, 18], 1000, seed=4))

    def failing(batch: Any) -> Any:
        raise error
    decode.engine.runner.execute = failing  # type: ignore[method-assign]
    with pytest.raises(type(error)):
        decode.step()
    decode.fail(error)
    final = [o for o in outputs if o.finish_reason == "error"]
    assert len(final) == 3 and all(o.in_failed_step is is_blamed for o in final)
    if is_blamed:
        assert len({o.failed_step_id for o in final}) == 1 and final[0].failed_step_id
        assert all(o.num_in_failed_step == 3 for o in final)
    else:
        assert all(not o.failed_step_id and not o.num_in_failed_step for o in final)


def test_suspects_moved_here_are_recomputed_together_then_batch_with_the_rest(tiny_llama_dir: Path) -> None:
    """Issue 48, defect 3 (review P1): four streams that shared a failed step come to a worker that runs a
    stream of its own. They are recomputed in one forward of their own (not one forward each), then decode
    in the same forwards as the worker's own stream; every token equals transformers'."""
    sampling = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = random_prompts([9, 13, 17, 21, 25], 1000, seed=6)
    decode, outputs = running_decode(tiny_llama_dir, prompts[:1], sampling)
    expected = hf_greedy(tiny_llama_dir, prompts, sampling.max_tokens)
    for index, prompt in enumerate(prompts[1:], start=1):  # moved with the first three tokens they had
        decode.submit(DecodeRequest(f"r{index}", tuple(prompt), sampling,
                                    generated_token_ids=tuple(expected[index][:3]), suspect_group="w9@1"),
                      outputs.append)
    records = decode.engine.runner.timeline
    num_before = len(records.since(0))
    while sum(o.finish_reason is not None for o in outputs) < len(prompts):
        decode.step()
    steps = records.since(0)[num_before:]
    recomputes = [s for s in steps if s.num_prefill_tokens]
    assert len(recomputes) == 1 and recomputes[0].num_decode_tokens == 0  # the group, apart, at once
    assert max(s.num_decode_tokens for s in steps) == len(prompts)  # then everyone in one forward
    tokens: dict[str, list[int]] = {f"r{i}": list(expected[i][:3]) for i in range(1, len(prompts))}
    tokens["r0"] = []
    for output in outputs:
        tokens[output.request_id].extend(output.token_ids)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert decode.engine.block_pool.is_whole()
