"""Reference outputs the engines are held to: random prompts, transformers' greedy `generate` and its plain
forward's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32, ignore_eos: bool = False) -> list[list[int]]:
    """Reference: transformers `generate`, one prompt at a time (no padding), greedy, stopping at EOS
    (unless `ignore_eos`: then exactly max_new_tokens). Computed once per pytest process for the same
    arguments: the kernel and dtype suites hold several engines to one reference (on SmolLM2 each costs
    seconds)."""
    key = (str(model_dir), tuple(map(tuple, prompts)), max_new_tokens, dtype, ignore_eos)
    if key not in _GREEDY_REFERENCES:
        _GREEDY_REFERENCES[key] = _hf_greedy(model_dir, prompts, max_new_tokens, dtype, ignore_eos)
    return [list(tokens) for tokens in _GREEDY_REFERENCES[key]]


_GREEDY_REFERENCES: dict[tuple[object, ...], list[list[int]]] = {}


def _hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int, dtype: torch.dtype,
               ignore_eos: bool) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                 min_new_tokens=max_new_tokens if ignore_eos else 0)
            outputs.append(ids[0, len(prompt):].tolist())
    return outputs


def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V] float32 logits of a plain forward."""
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy_top5(model_dir: Path, prompt: list[int], steps: int, dtype: torch.dtype
                   ) -> tuple[list[int], list[set[int]]]:
    """transformers' greedy tokens for `prompt` (stopping at EOS, as the engine's request does: forcing
    tokens past it would mask EOS out of these scores only), and its top-5 token ids at each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [set(scores[0].topk(5).indices.tolist()) for scores in out.scores]


def assert_close_as_vllm_does(ours: list[int], our_top: list[set[int]], theirs: list[int],
                              their_top: list[set[int]]) -> None:
    """vLLM's check_logprobs_close: equal up to the first difference, and there each side's token is in the
    other's top-5 (nothing is compared after it: the contexts differ from then on)."""
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):  # equal prefixes end together
        if a != b:
            assert a in their_top[position] and b in our_top[position], f"diverged at {position}"
            return


def assert_engine_close_to_transformers(engine: Any, reference_dir: Path, prompts: list[list[int]],
                                        steps: int, dtype: torch.dtype = torch.float32) -> None:
    """Each prompt generated greedily by `engine` (an LLMEngine, its top-5 logprobs), one at a time, held to
    vLLM's standard against transformers' greedy run of `reference_dir` in `dtype`."""
    from llm_engine import SamplingParams

    params = SamplingParams(max_tokens=steps, temperature=0.0, logprobs=True, top_logprobs=5)
    for prompt in prompts:
        [completion] = engine.generate([prompt], params)
        our_top = [{t for t, _ in step} for step in completion.output_top_logprobs]
        theirs, their_top = hf_greedy_top5(reference_dir, prompt, steps, dtype)
        assert_close_as_vllm_does(list(completion.output_token_ids), our_top, theirs, their_top)
