"""vLLM's sampling extensions in the engine, against transformers' own logits: top_k, min_p, bad_words,
allowed_token_ids and prompt_logprobs (values and ranks). A request resumed on another engine with its output
so far (what a decode worker or a migration does) forbids the same tokens as one engine alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from llm_engine.params import SamplingParams
from llm_engine.request import Request
from llm_engine.sampling import choose_tokens
from tests.helpers.engines import make_engine
from tests.helpers.reference import hf_logits, random_prompts

VOCAB = 1000


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return random_prompts([30], VOCAB, seed=5)[0]


def test_top_k_1_is_greedy(tiny_llama_dir: Path, prompt: list[int]) -> None:
    engine = make_engine(tiny_llama_dir)
    [greedy, top1, top1_seeded] = engine.generate([prompt] * 3, [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3, ignore_eos=True)])
    assert top1.output_token_ids == greedy.output_token_ids == top1_seeded.output_token_ids
    assert engine.block_pool.is_whole()


def test_top_k_draws_only_among_the_k_most_likely(hf_model: torch.nn.Module, prompt: list[int]) -> None:
    logits = hf_logits(hf_model, prompt)[-1]
    rows = logits.repeat(400, 1)  # [400, V]: many draws from one distribution
    drawn = choose_tokens(rows, [SamplingParams(temperature=2.0, top_k=3)] * 400, [0] * 400)
    top3 = set(torch.topk(logits, 3).indices.tolist())
    assert set(drawn.tolist()) <= top3
    assert len(set(drawn.tolist())) > 1  # it did sample


@pytest.mark.parametrize("seeded", [False, True])
def test_min_p_drops_the_unlikely(hf_model: torch.nn.Module, prompt: list[int], seeded: bool) -> None:
    logits = hf_logits(hf_model, prompt)[-1]
    temperature = 3.0  # flat enough that many tokens have a fair share
    probs = torch.softmax(logits / temperature, dim=-1)
    min_p = 0.5
    kept = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    assert 1 < len(kept) < 50, "the case needs a few tokens above the threshold and many below"
    params = [SamplingParams(temperature=temperature, min_p=min_p, seed=i if seeded else None)
              for i in range(300)]
    drawn = choose_tokens(logits.repeat(300, 1), params, [0] * 300)
    assert set(drawn.tolist()) <= kept
    unfiltered = choose_tokens(logits.repeat(300, 1), [SamplingParams(temperature=temperature)] * 300,
                               [0] * 300)
    assert not set(unfiltered.tolist()) <= kept, "without min_p the draws leave the kept set"


def test_min_p_1_is_greedy(tiny_llama_dir: Path, prompt: list[int]) -> None:
    engine = make_engine(tiny_llama_dir)
    [greedy, min_p] = engine.generate([prompt] * 2, [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.0, min_p=1.0, ignore_eos=True)])
    assert min_p.output_token_ids == greedy.output_token_ids


def _contains(tokens: tuple[int, ...], word: tuple[int, ...]) -> bool:
    return any(tokens[i : i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_never_appear(tiny_llama_dir: Path, prompt: list[int]) -> None:
    engine = make_engine(tiny_llama_dir)
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    [plain] = engine.generate([prompt], greedy)
    out = plain.output_token_ids
    one = (out[2],)
    two = (out[5], out[6])
    assert out[6] != out[2]
    [banned] = engine.generate([prompt], dataclasses.replace(greedy, bad_words=(one, two)))
    assert one[0] not in banned.output_token_ids
    assert not _contains(banned.output_token_ids, two)
    assert banned.output_token_ids[:2] == out[:2]  # nothing changes before the first ban bites
    # Sampled too: many seeds, none writes a banned word.
    sampled = engine.generate([prompt] * 8, [SamplingParams(max_tokens=20, temperature=1.0, seed=s,
                                                            bad_words=(one, two), ignore_eos=True)
                                             for s in range(8)])
    for completion in sampled:
        assert one[0] not in completion.output_token_ids
        assert not _contains(completion.output_token_ids, two)
    assert engine.block_pool.is_whole()


def test_bad_words_state_travels_with_the_tokens(tiny_llama_dir: Path, prompt: list[int]) -> None:
    """A request resumed on a second engine with its output so far (a decode worker after the prefill
    worker's first token, or a migration) bans a word whose first token the first engine wrote."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    [plain] = make_engine(tiny_llama_dir).generate([prompt], greedy)
    out = plain.output_token_ids
    word = (out[3], out[4])
    params = dataclasses.replace(greedy, bad_words=(word,))
    [alone] = make_engine(tiny_llama_dir).generate([prompt], params)
    assert not _contains(alone.output_token_ids, word) and alone.output_token_ids[:4] == out[:4]
    # The same request, its first 4 tokens on engine A, the rest on engine B.
    [head] = make_engine(tiny_llama_dir).generate([prompt], dataclasses.replace(params, max_tokens=4))
    assert head.output_token_ids == out[:4]
    second = make_engine(tiny_llama_dir)
    request = Request("moved", list(prompt), params, frozenset(),
                      output_token_ids=list(head.output_token_ids))
    second.scheduler.add(request)
    while not request.is_finished:
        second.step()
    assert tuple(request.output_token_ids) == alone.output_token_ids
    assert second.block_pool.is_whole()


def test_allowed_token_ids_restrict_the_choice(tiny_llama_dir: Path, hf_model: torch.nn.Module,
                                               prompt: list[int]) -> None:
    allowed = (5, 17, 99, 400)
    engine = make_engine(tiny_llama_dir)
    [greedy] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                        allowed_token_ids=allowed))
    # Greedy among the allowed: the argmax of transformers' logits over those ids, step by step.
    expected: list[int] = []
    for _ in range(6):
        row = hf_logits(hf_model, prompt + expected)[-1]
        expected.append(max(allowed, key=lambda t: row[t].item()))
    assert list(greedy.output_token_ids) == expected
    sampled = engine.generate([prompt] * 6, [SamplingParams(max_tokens=10, temperature=2.0, seed=s,
                                                            allowed_token_ids=allowed, ignore_eos=True)
                                             for s in range(6)])
    tokens = {t for c in sampled for t in c.output_token_ids}
    assert tokens <= set(allowed) and len(tokens) > 1
    assert engine.block_pool.is_whole()


def test_prompt_logprobs_shape_values_and_ranks(tiny_llama_dir: Path, hf_model: torch.nn.Module,
                                                prompt: list[int]) -> None:
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)  # two chunks
    [completion] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=4))
    scored = completion.prompt_logprobs
    assert scored is not None
    assert len(scored.logprobs) == len(scored.top) == len(scored.ranks) == len(prompt) - 1
    expected = torch.log_softmax(hf_logits(hf_model, prompt), dim=-1)  # [P, V]
    for position in range(1, len(prompt)):
        row = expected[position - 1]
        token = prompt[position]
        assert scored.logprobs[position - 1] == pytest.approx(row[token].item(), abs=1e-4)
        assert len(scored.top[position - 1]) == 4
        assert [t for t, _ in scored.top[position - 1]] == torch.topk(row, 4).indices.tolist()
        assert scored.ranks[position - 1] == int((row > row[token]).sum().item()) + 1
    [none] = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert none.prompt_logprobs is not None and all(top == () for top in none.prompt_logprobs.top)
    assert engine.block_pool.is_whole()


def test_invalid_values_are_refused() -> None:
    for bad in ({"min_p": 1.5}, {"min_p": -0.1}, {"allowed_token_ids": ()}, {"bad_words": ((),)},
                {"bad_words": ((-1,),)}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
