"""KV migration between two decode workers in one process (real engines, real NIXL agents over UCX, stepped by
hand): a stream evacuated from one worker continues on the other from the pulled KV, token-equal to
transformers, and both workers end whole."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from decode_pool.messages import DecodeOutput, DecodeRequest
from decode_pool.worker import DecodeWorker
from kv_transfer import TransferConfig, make_receiver, make_sender
from llm_engine import EngineConfig, LLMEngine, SamplingParams
from tests.helpers.reference import hf_greedy, random_prompts
from worker_runtime.kv_offers import KVOffers

pytest.importorskip("nixl._bindings")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
_names = itertools.count()


def make_decode_worker(model_dir: Path, name: str) -> DecodeWorker:
    """A decode worker as DecodeWorker.create builds it with nixl: receiver and migration sender over one KV
    cache."""
    engine = LLMEngine(EngineConfig(str(model_dir), dtype="float32", kv_cache_bytes=8 << 20), watermark=0.05)
    config = TransferConfig(lease_s=30.0)
    kv_cache = engine.runner.kv_cache
    receiver = make_receiver("nixl", name, kv_cache, config=config)
    migration = KVOffers(make_sender("nixl", name, kv_cache, config=config), engine.kv, "migration")
    return DecodeWorker(name, engine, receiver, migration=migration)


class Outputs:
    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.final: dict[str, DecodeOutput] = {}

    def __call__(self, output: DecodeOutput) -> None:
        self.tokens.setdefault(output.request_id, []).extend(output.token_ids)
        if output.finish_reason:
            self.final[output.request_id] = output


def step_until(workers: list[DecodeWorker], done: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Steps the workers until `done()`. Bounded by time, not by a step count: a step waiting on a pull is
    quick, and under a loaded machine the peer's polling thread may need many of them to answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for worker in workers:
            worker.step()
        if done():
            return
    raise AssertionError(f"the workers did not get there in {timeout_s:.0f} s")


def pair(model_dir: Path) -> tuple[DecodeWorker, DecodeWorker]:
    n = next(_names)
    first, second = make_decode_worker(model_dir, f"dA{n}"), make_decode_worker(model_dir, f"dB{n}")
    assert first.offers is not None and second.offers is not None
    second.add_peer(first.offers.peer_info())
    first.add_peer(second.offers.peer_info())
    return first, second


def test_an_evacuated_stream_continues_from_pulled_kv(tiny_llama_dir: Path) -> None:
    prompts = random_prompts([5, 40, 70], 1000, seed=7)
    first, second = pair(tiny_llama_dir)
    seen = Outputs()
    for index, prompt in enumerate(prompts):
        first.submit(DecodeRequest(f"r{index}", tuple(prompt), GREEDY), seen)
    # A few tokens each (block boundaries differ per prompt), then the worker hands the streams back.
    step_until([first], lambda: all(len(seen.tokens.get(f"r{i}", ())) >= 5 for i in range(len(prompts))))
    first.evacuate()
    step_until([first], lambda: len(seen.final) == len(prompts))
    handles = {rid: out.kv_handle for rid, out in seen.final.items()}
    assert all(out.finish_reason == "migrate" for out in seen.final.values())
    assert all(h is not None for h in handles.values())
    assert first.load().num_requests == len(prompts)  # the offers hold their blocks: not drained yet

    moved = Outputs()
    for index, prompt in enumerate(prompts):
        rid = f"r{index}"
        moved.tokens[rid] = list(seen.tokens[rid])
        second.submit(DecodeRequest(rid, tuple(prompt), GREEDY, generated_token_ids=tuple(seen.tokens[rid]),
                                    kv_handle=handles[rid]), moved)
    step_until([first, second], lambda: len(moved.final) == len(prompts) and first.load().num_requests == 0)

    expected = hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)
    assert [moved.tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert all(out.transfer_bytes > 0 for out in moved.final.values())  # pulled, not recomputed
    assert first.engine.block_pool.is_whole() and second.engine.block_pool.is_whole()


def test_a_refused_migration_is_recomputed_and_frees_the_source(tiny_llama_dir: Path) -> None:
    """The next worker does not know the evacuated one (no peer): it recomputes, and the source's blocks
    come back through release() at once, not at the lease's end."""
    prompt = random_prompts([33], 1000, seed=3)[0]
    first, _ = pair(tiny_llama_dir)
    stranger = make_decode_worker(tiny_llama_dir, f"dC{next(_names)}")
    seen = Outputs()
    first.submit(DecodeRequest("r", tuple(prompt), GREEDY), seen)
    step_until([first], lambda: len(seen.tokens.get("r", ())) >= 3)
    first.evacuate()
    step_until([first], lambda: "r" in seen.final)
    handle = seen.final["r"].kv_handle
    assert handle is not None

    moved = Outputs()
    moved.tokens["r"] = list(seen.tokens["r"])
    stranger.release_source = lambda h, why: first.release_kv(h.transfer_id, why)
    stranger.submit(DecodeRequest("r", tuple(prompt), GREEDY, generated_token_ids=tuple(seen.tokens["r"]),
                                  kv_handle=handle), moved)
    step_until([first, stranger], lambda: "r" in moved.final and first.load().num_requests == 0)
    assert moved.tokens["r"] == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]
    assert moved.final["r"].transfer_bytes == 0
    assert first.engine.block_pool.is_whole() and stranger.engine.block_pool.is_whole()


def test_a_stream_moved_out_is_pulled_while_its_source_does_not_step(tiny_llama_dir: Path) -> None:
    """move_out() hands back only the requests named: a stream with its KV, a prompt not started as it came.
    With the migration sender polled on its own thread, the next worker's pull is answered while the source
    runs no step (as if it were in a long prompt's chunk); the moved stream and the one left behind both
    match transformers."""
    prompts = random_prompts([20, 45], 1000, seed=11)
    first, second = pair(tiny_llama_dir)
    assert first.offers is not None
    first.offers.start_polling(lambda: None)
    seen = Outputs()
    for index, prompt in enumerate(prompts):
        first.submit(DecodeRequest(f"r{index}", tuple(prompt), GREEDY), seen)
    step_until([first], lambda: all(len(seen.tokens.get(f"r{i}", ())) >= 4 for i in range(len(prompts))))
    first.submit(DecodeRequest("waiting", tuple(prompts[1]), GREEDY), seen)  # not started when asked
    first.move_out(["r0", "waiting", "gone"])  # an id not here is ignored
    first.step()
    assert set(seen.final) == {"r0", "waiting"}
    assert seen.final["waiting"].finish_reason == "migrate" and seen.final["waiting"].kv_handle is None
    assert seen.final["r0"].finish_reason == "migrate"
    handle = seen.final["r0"].kv_handle
    assert handle is not None

    moved = Outputs()
    moved.tokens["r0"] = list(seen.tokens["r0"])
    second.submit(DecodeRequest("r0", tuple(prompts[0]), GREEDY, generated_token_ids=tuple(seen.tokens["r0"]),
                                kv_handle=handle), moved)
    step_until([second], lambda: "r0" in moved.final)  # the source does not step meanwhile
    assert moved.final["r0"].transfer_bytes > 0  # pulled, not recomputed
    step_until([first], lambda: "r1" in seen.final and first.load().num_requests == 0)
    expected = hf_greedy(tiny_llama_dir, prompts, GREEDY.max_tokens)
    assert [moved.tokens["r0"], seen.tokens["r1"]] == expected
    first.offers.close()
    assert first.engine.block_pool.is_whole() and second.engine.block_pool.is_whole()


def test_a_stream_handed_back_to_the_worker_still_leasing_its_kv_continues(tiny_llama_dir: Path) -> None:
    """The role-flip defect (issue 48): a stream moved off a worker came back to it while that worker's
    migration lease still held the stream's old blocks. Its step loop died on "already holds blocks". The
    lease's blocks are the lease's, not the request's: the id is free once its last output went out, the
    stream continues here (recomputed: a worker does not pull from itself) and every block comes back."""
    prompt = random_prompts([37], 1000, seed=5)[0]
    first, _ = pair(tiny_llama_dir)
    seen = Outputs()
    first.submit(DecodeRequest("r", tuple(prompt), GREEDY), seen)
    step_until([first], lambda: len(seen.tokens.get("r", ())) >= 4)
    first.move_out(["r"])
    step_until([first], lambda: "r" in seen.final)
    handle = seen.final["r"].kv_handle
    assert handle is not None and first.load().num_requests == 1  # the lease holds the old blocks

    back = Outputs()
    back.tokens["r"] = list(seen.tokens["r"])
    first.release_source = lambda h, why: first.release_kv(h.transfer_id, why)
    first.submit(DecodeRequest("r", tuple(prompt), GREEDY, generated_token_ids=tuple(seen.tokens["r"]),
                               kv_handle=handle), back)
    step_until([first], lambda: "r" in back.final and first.load().num_requests == 0)
    assert not first.failure
    assert back.tokens["r"] == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]
    assert first.engine.block_pool.is_whole()


def test_a_submission_under_an_id_still_live_here_is_refused_at_submit(tiny_llama_dir: Path) -> None:
    """Two submissions under one id would share a block table: the second is refused to its caller
    (ValueError, which the actor answers as a refusal) and the step loop serves on."""
    prompt = random_prompts([21], 1000, seed=8)[0]
    first, _ = pair(tiny_llama_dir)
    seen = Outputs()
    first.submit(DecodeRequest("r", tuple(prompt), GREEDY), seen)
    with pytest.raises(ValueError, match="already"):  # still in the inbox
        first.submit(DecodeRequest("r", tuple(prompt), GREEDY), seen)
    step_until([first], lambda: len(seen.tokens.get("r", ())) >= 2)
    with pytest.raises(ValueError, match="already"):  # running
        first.submit(DecodeRequest("r", tuple(prompt), GREEDY), seen)
    step_until([first], lambda: "r" in seen.final)
    assert not first.failure and seen.final["r"].finish_reason == "length"
    assert seen.tokens["r"] == hf_greedy(tiny_llama_dir, [prompt], GREEDY.max_tokens)[0]
    assert first.engine.block_pool.is_whole()
