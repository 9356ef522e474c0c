"""Text prompts for `pdserve bench`: ShareGPT conversations, and random words for the chat endpoint.

ShareGPT's JSON is a list of `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`:
the first human turn is the prompt and the turn after it the reply, whose length in tokens (with a
tokenizer) is the request's max_tokens, unless a fixed output length is given (vLLM's
`--sharegpt-output-len`). A chat request carries text, not token ids: random-length prompts become that
many random words (about one token each in a BPE vocabulary; the server's usage gives the true count).
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

from loadgen.workload import RequestSpec, poisson_arrivals

# Common short words, one BPE token each in most vocabularies.
_WORDS = ("the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "was", "with", "as", "at", "by",
          "this", "from", "or", "an", "be", "are", "not", "but", "all", "we", "can", "one", "has", "more",
          "will", "time", "new", "day", "way", "man", "work", "life", "world", "water", "light", "house")


def read_sharegpt(path: str | Path) -> list[tuple[str, str]]:
    """(prompt, reply) of each conversation with a human turn followed by another turn.

    Raises:
        ValueError: not ShareGPT's JSON (a list of objects with `conversations`), or no usable conversation.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected ShareGPT's list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(turns, list):
            continue
        for first, second in itertools.pairwise(turns):
            if isinstance(first, dict) and first.get("from") == "human" and isinstance(second, dict):
                pairs.append((str(first.get("value", "")), str(second.get("value", ""))))
                break
    pairs = [(prompt, reply) for prompt, reply in pairs if prompt.strip()]
    if not pairs:
        raise ValueError(f"{path}: no conversation with a human turn and a reply")
    return pairs


def sharegpt_requests(path: str | Path, count: int, seed: int, rate: float, burstiness: float,
                      output_len: int | None, tokenizer_dir: str | None) -> list[RequestSpec]:
    """`count` requests drawn (shuffled by `seed`, repeated if the file has fewer) from a ShareGPT file.

    Raises:
        ValueError: neither a fixed output length nor a tokenizer to count the replies' tokens.
    """
    if output_len is None and tokenizer_dir is None:
        raise ValueError("ShareGPT needs --sharegpt-output-len, or --tokenizer to count each reply's tokens")
    pairs = read_sharegpt(path)
    rng = random.Random(seed)
    rng.shuffle(pairs)
    arrivals = poisson_arrivals(rate, count, random.Random(seed), burstiness)
    tokenizer = None
    if output_len is None and tokenizer_dir is not None:
        from llm_engine.model_files import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_dir)
    specs = []
    for index, arrival in enumerate(arrivals):
        prompt, reply = pairs[index % len(pairs)]
        n_out = output_len if tokenizer is None else len(tokenizer.encode(reply, add_special_tokens=False))
        specs.append(RequestSpec(index, arrival, (), max(1, n_out or 1), prompt_text=prompt))
    return specs


def as_text(specs: list[RequestSpec], seed: int) -> list[RequestSpec]:
    """The same requests with a text prompt of as many random words as they had token ids (for chat)."""
    rng = random.Random(f"words-{seed}")
    return [spec if spec.prompt_text is not None else
            replace(spec, prompt_text=" ".join(rng.choice(_WORDS) for _ in spec.prompt_token_ids))
            for spec in specs]
