"""The greedy requests' prompts and what they must answer: transformers' `generate` on the same model in
float32, one prompt at a time, exactly max_greedy_tokens tokens (the requests set ignore_eos). A greedy
request for n tokens must get the first n; one cut short by an error or a cancellation, a prefix of them.

The reference stops before the first step whose two best logits are within TIE_MARGIN of each other: there
greedy is a coin toss of float32 rounding (a prompt recomputed in other chunks, or read from the prefix
cache, sums in another order), not a property of the server. Seen: a 441-token prompt whose 21st token had
a margin of 1.3e-5: the first request for it matched, the four after it took the other token there."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

# Logits. Margins of 1.3e-4 held across every earlier run (seed 0's pool has one); 1.3e-5 flipped.
TIE_MARGIN = 1e-4


@dataclass(frozen=True)
class GreedyPrompt:
    prompt_token_ids: tuple[int, ...]
    # transformers' greedy tokens after the prompt: max_greedy_tokens, or fewer where a near-tie comes first
    reference: tuple[int, ...]


def greedy_prompts(rng: random.Random, vocab_size: int, count: int, long_fraction: float,
                   max_prompt_len: int) -> list[tuple[int, ...]]:
    """Random prompts, short (4-64 tokens) and long (300-700, at most max_prompt_len)."""
    prompts = []
    for index in range(count):
        is_long = index < max(1, round(count * long_fraction))
        num = rng.randint(300, 700) if is_long else rng.randint(4, 64)
        prompts.append(tuple(rng.randrange(vocab_size) for _ in range(min(num, max_prompt_len))))
    return prompts


def greedy_reference(model_dir: Path, prompts: list[tuple[int, ...]], num_tokens: int) -> list[GreedyPrompt]:
    """Greedy decoding with transformers' KV cache, as `generate` does it, but never stopping at EOS and
    never masking it (the server's ignore_eos keeps EOS as a token and goes on)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            step = model(torch.tensor([list(prompt)]), use_cache=True)
            tokens: list[int] = []
            while True:
                best, second = step.logits[0, -1].topk(2).values.tolist()
                if best - second < TIE_MARGIN:
                    break
                tokens.append(int(step.logits[0, -1].argmax()))
                if len(tokens) == num_tokens:
                    break
                step = model(torch.tensor([[tokens[-1]]]), cache=step.cache, use_cache=True)
            out.append(GreedyPrompt(prompt, tuple(tokens)))
    return out
