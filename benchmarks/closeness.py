"""Greedy closeness by vLLM's standard (its tests' check_logprobs_close), for the bf16 and GPU checks:
equal up to the first differing token, and there each side's token is among the other's top-5.

Both sides stop at EOS (the engine's requests must not set ignore_eos): forcing more tokens through
`min_new_tokens` masks EOS out of transformers' scores while the engine, ignoring EOS only as a stop, may
still choose it, a difference of procedure that once read as "not close"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def reference(model_dir: Path, prompts: list[list[int]], steps: int, dtype: torch.dtype, device: str
              ) -> list[tuple[list[int], list[set[int]]]]:
    """transformers' greedy tokens for each prompt (up to `steps`, EOS included where it stops), and its
    top-5 token ids per step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=steps,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True)
            outputs.append((out.sequences[0, len(prompt):].tolist(),
                            [set(s[0].topk(5).indices.tolist()) for s in out.scores]))
    return outputs


def first_divergence(ours: list[int], our_top: list[set[int]], theirs: list[int], their_top: list[set[int]]
                     ) -> dict[str, Any]:
    """{"position": the first differing step or None, "close": vLLM's verdict there}."""
    # Equal prefixes end together: each side's last token is EOS or the step limit.
    for position, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return {"position": position, "close": a in their_top[position] and b in our_top[position]}
    return {"position": None, "close": True}
