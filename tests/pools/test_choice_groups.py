"""A request with several choices through a prefill worker and a decode worker in one process, stepped by
hand: one pull, a fork into one request per choice, each equal to n = 1 when greedy; a choice aborted, or
the whole group evacuated, while the pull is pending; both workers end whole."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from decode_pool.messages import DecodeOutput, DecodeRequest
from decode_pool.worker import DecodeWorker
from llm_engine import SamplingParams
from llm_engine.choices import choice_request_id
from prefill_pool.messages import PrefillRequest, PrefillResult
from prefill_pool.worker import PrefillWorker
from tests.helpers.engines import make_pair
from tests.helpers.reference import random_prompts

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def prefilled(prefill: PrefillWorker, prompt: list[int], sampling: SamplingParams) -> PrefillResult:
    results: list[PrefillResult] = []
    prefill.submit(PrefillRequest("r", tuple(prompt), sampling), results.append)
    while not results:
        prefill.step()
    return results[0]


def decoded(prefill: PrefillWorker, decode: DecodeWorker, prompt: list[int], sampling: SamplingParams,
            before_steps: str = "") -> dict[str, DecodeOutput]:
    """The group's outputs per choice id (tokens joined, the last output's finish_reason); `before_steps`:
    "abort 1" aborts choice 1, "evacuate" evacuates the worker, before the decode worker's first step."""
    result = prefilled(prefill, prompt, sampling)
    group = DecodeRequest("r", tuple(prompt), sampling, kv_handle=result.kv_handle, choices=result.choices)
    outputs: dict[str, DecodeOutput] = {}

    def on_output(out: DecodeOutput) -> None:
        before = outputs.get(out.request_id)
        joined = before.token_ids + out.token_ids if before else out.token_ids
        outputs[out.request_id] = replace(out, token_ids=joined)

    decode.submit(group, on_output)
    if before_steps == "abort 1":
        decode.abort(choice_request_id("r", 1))
    elif before_steps == "evacuate":
        decode.evacuate()
    for _ in range(1000):
        decode.step()
        prefill.step()
        if len(outputs) == sampling.n and all(o.finish_reason for o in outputs.values()):
            break
    assert result.kv_handle is not None
    # As the gateway does at the request's end (ChoicesRun): a pulled lease is left alone, an unpulled freed.
    prefill.release_kv(result.kv_handle.transfer_id, "the request ended")
    for _ in range(3):
        prefill.step()  # the sender sees the pull (or the release) and frees the prompt's blocks
    assert prefill.engine.block_pool.is_whole() and decode.engine.block_pool.is_whole()
    firsts = {choice_request_id("r", c.index): c.token_id for c in result.choices}
    return {i: replace(o, token_ids=(firsts[i], *o.token_ids)) for i, o in outputs.items()}


def test_greedy_choices_fork_from_one_pull(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    prompt = random_prompts([40], 1000, seed=5)[0]
    alone = decoded(prefill, decode, prompt, GREEDY)  # n = 1 is a group of one here
    three = decoded(prefill, decode, prompt, replace(GREEDY, n=3))
    assert sorted(three) == [choice_request_id("r", i) for i in range(3)]
    assert {o.token_ids for o in three.values()} == {alone[choice_request_id("r", 0)].token_ids}
    assert all(o.finish_reason == "length" and o.transfer_bytes > 0 for o in three.values())


def test_a_choice_aborted_before_the_split_ends_alone(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    prompt = random_prompts([40], 1000, seed=6)[0]
    outputs = decoded(prefill, decode, prompt, replace(GREEDY, n=3), before_steps="abort 1")
    assert outputs[choice_request_id("r", 1)].finish_reason == "abort"
    assert [outputs[choice_request_id("r", i)].finish_reason for i in (0, 2)] == ["length", "length"]


def test_a_group_evacuated_before_its_split_hands_back_every_choice(tiny_llama_dir: Path) -> None:
    prefill, decode = make_pair(tiny_llama_dir)
    prompt = random_prompts([40], 1000, seed=7)[0]
    outputs = decoded(prefill, decode, prompt, replace(GREEDY, n=2), before_steps="evacuate")
    assert [o.finish_reason for o in outputs.values()] == ["migrate", "migrate"]
    assert all(o.kv_handle is None for o in outputs.values())  # one lease: each choice recomputes elsewhere
