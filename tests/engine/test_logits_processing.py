"""Penalties, logit_bias and min_tokens change the engine's tokens exactly as an independent reference does
(transformers' logits, the OpenAI/vLLM formulas written out token by token); top logprobs and prompt logprobs
are transformers' log-softmax. Batched, chunked and preempted requests give the same tokens as one alone."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
import torch

from llm_engine import SamplingParams
from tests.helpers.engines import make_engine
from tests.helpers.reference import hf_logits, random_prompts

VOCAB = 1000


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def reference_greedy(model: torch.nn.Module, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with the processing written out per token, independently of the engine's code."""
    output: list[int] = []
    for _ in range(p.max_tokens):
        logits = hf_logits(model, prompt + output)[-1].tolist()
        for token, bias in p.logit_bias:
            logits[token] += bias
        if len(output) < p.min_tokens:
            for token in p.stop_token_ids:
                logits[token] = float("-inf")
        counts = Counter(output)
        for token in set(prompt) | set(output):
            if logits[token] > 0:
                logits[token] /= p.repetition_penalty
            else:
                logits[token] *= p.repetition_penalty
        for token, count in counts.items():
            logits[token] -= p.frequency_penalty * count + p.presence_penalty
        token = max(range(len(logits)), key=logits.__getitem__)
        output.append(token)
        if token in p.stop_token_ids:
            break
    return output


CASES = {
    "presence": SamplingParams(max_tokens=20, temperature=0, presence_penalty=2.0),
    "frequency": SamplingParams(max_tokens=20, temperature=0, frequency_penalty=0.7),
    "repetition": SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.8),
    "all three": SamplingParams(max_tokens=20, temperature=0, presence_penalty=-0.5, frequency_penalty=1.0,
                                repetition_penalty=1.3),
    "logit_bias": SamplingParams(max_tokens=12, temperature=0, logit_bias=((5, 8.0), (17, -100.0))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processing_matches_the_reference_and_changes_the_output(
        tiny_llama_dir: Path, hf_model: torch.nn.Module,
        name: str) -> None:
    params = CASES[name]
    prompt = random_prompts([40], VOCAB, seed=5)[0]  # greedy repeats a token here
    engine = make_engine(tiny_llama_dir)
    [plain, processed] = engine.generate([prompt, prompt], [dataclasses.replace(
        params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=()), params])
    assert list(processed.output_token_ids) == reference_greedy(hf_model, prompt, params)
    assert processed.output_token_ids != plain.output_token_ids, "the processing changed nothing"
    assert engine.block_pool.is_whole()


def test_min_tokens_holds_back_a_stop_token(tiny_llama_dir: Path, hf_model: torch.nn.Module) -> None:
    prompt = random_prompts([30], VOCAB, seed=4)[0]
    engine = make_engine(tiny_llama_dir)
    [free] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))
    stop = free.output_token_ids[1]  # greedy would stop at the second token
    params = SamplingParams(max_tokens=8, temperature=0, stop_token_ids=(stop,), min_tokens=4)
    [held] = engine.generate([prompt], params)
    assert list(held.output_token_ids) == reference_greedy(hf_model, prompt, params)
    assert len(held.output_token_ids) >= 4 and stop not in held.output_token_ids[:4]
    [early] = engine.generate([prompt], dataclasses.replace(params, min_tokens=0))
    assert early.output_token_ids == free.output_token_ids[:2] and early.finish_reason == "stop"


def test_penalties_survive_batching_chunking_and_preemption(tiny_llama_dir: Path,
                                                            hf_model: torch.nn.Module) -> None:
    """Many penalised requests over a KV cache too small for all of them: chunked prompts, preemptions
    (the history is sent again after each), and every one still equals its reference."""
    prompts = random_prompts([60, 45, 70, 30, 55, 64], VOCAB, seed=5)
    params = [dataclasses.replace(CASES["all three"], max_tokens=24, presence_penalty=0.2 * i)
              for i in range(len(prompts))]
    engine = make_engine(tiny_llama_dir, num_blocks=20, max_num_batched_tokens=32)
    completions = engine.generate(prompts, params)
    assert sum(c.num_preemptions for c in completions) > 0, "no preemption: the test proves less"
    for prompt, p, completion in zip(prompts, params, completions, strict=True):
        assert list(completion.output_token_ids) == reference_greedy(hf_model, prompt, p)
    assert engine.block_pool.is_whole()


def test_top_logprobs_are_transformers_log_softmax(tiny_llama_dir: Path, hf_model: torch.nn.Module) -> None:
    prompt = random_prompts([25], VOCAB, seed=6)[0]
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=True, top_logprobs=5, presence_penalty=1.0)
    [completion] = engine.generate([prompt], params)
    expected = torch.log_softmax(hf_logits(hf_model, prompt + list(completion.output_token_ids)), dim=-1)
    for i, (token, logprob, top) in enumerate(zip(completion.output_token_ids, completion.output_logprobs,
                                                   completion.output_top_logprobs, strict=True)):
        row = expected[len(prompt) - 1 + i]  # raw: before the penalty that chose the token
        assert logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, indices = torch.topk(row, 5)
        assert [t for t, _ in top] == indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("prefix_cached", [False, True])
def test_prompt_logprobs_are_transformers_log_softmax(tiny_llama_dir: Path, hf_model: torch.nn.Module,
                                                      prefix_cached: bool) -> None:
    prompt = random_prompts([70], VOCAB, seed=8)[0]
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32)  # three chunks
    if prefix_cached:  # the prompt's blocks are in the prefix cache: still every token is scored
        engine.generate([prompt], SamplingParams(max_tokens=1))
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))
    scored = completion.prompt_logprobs
    assert scored is not None and len(scored.logprobs) == len(prompt) - 1
    expected = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)  # [P, V]
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        assert scored.logprobs[position - 1] == pytest.approx(row[prompt[position]].item(), abs=1e-4)
        assert [t for t, _ in scored.top[position - 1]] == torch.topk(row, 3).indices.tolist()
    assert engine.block_pool.is_whole()
