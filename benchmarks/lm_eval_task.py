"""A small multiple-choice task for lm-eval that needs no dataset hub: items made by a seeded generator and
written as a local JSON-lines file with a task YAML beside it (`dataset_path: json`, `data_files`).

Why made up rather than one of lm-eval's own tasks: those download their data from the Hugging Face hub, which
this machine cannot reach. What matters for benchmarks/lm_eval_parity.py is not the task's difficulty but
that both backends score the same (context, continuation) pairs, so the items only need to be reproducible,
varied in length (so acc_norm, which divides by the continuation's bytes, can differ from acc), and neither
trivial nor hopeless for a 135M model: arithmetic, sequences (days, months, letters, number words, counting
by a step) and comparisons.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TASK_NAME = "pdserve_parity"
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
NUMBER_WORDS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen",
                "twenty"]
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]


def _choices(rng: random.Random, answer: str, distractors: list[str]) -> tuple[list[str], int]:
    """Four distinct choices (the answer among three distractors), shuffled; and the answer's index."""
    pool = [d for d in dict.fromkeys(distractors) if d != answer]
    picked = [*rng.sample(pool, 3), answer]
    rng.shuffle(picked)
    return picked, picked.index(answer)


def _arithmetic(rng: random.Random) -> dict[str, Any]:
    op = rng.choice(["+", "-", "*"])
    a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 99), rng.randint(1, 99))
    if op == "-" and b > a:
        a, b = b, a
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    # Distractors of other lengths too (value × 10, a lone digit), so acc_norm weighs choices differently.
    near = [value + d for d in (-11, -10, -2, -1, 1, 2, 10, 11) if value + d >= 0] + [value * 10, value % 10]
    choices, answer = _choices(rng, str(value), [str(n) for n in near])
    return {"question": f"Question: What is {a} {op} {b}?\nAnswer:", "choices": [f" {c}" for c in choices],
            "answer": answer}


def _sequence(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["days", "months", "letters", "words", "step"])
    if kind == "step":
        step, start = rng.randint(2, 9), rng.randint(0, 50)
        items = [str(start + step * i) for i in range(8)]
    else:
        items = {"days": DAYS, "months": MONTHS, "letters": LETTERS, "words": NUMBER_WORDS}[kind]
    shown = rng.randint(3, 4)
    first = rng.randint(0, len(items) - shown - 1)
    context, answer = items[first:first + shown], items[first + shown]
    # Items not shown first; the shown ones (bar the last) keep a short list (days) at three distractors.
    others = [x for x in items if x not in context] + context[:-1]
    choices, index = _choices(rng, answer, others)
    return {"question": "Continue the list: " + ", ".join(context) + ",",
            "choices": [f" {c}" for c in choices], "answer": index}


def _comparison(rng: random.Random) -> dict[str, Any]:
    a, b = rng.sample(range(1, 1000), 2)
    word = rng.choice(["larger", "smaller"])
    answer = max(a, b) if word == "larger" else min(a, b)
    choices = [f" {a}", f" {b}"]
    return {"question": f"Question: Which number is {word}, {a} or {b}?\nAnswer:", "choices": choices,
            "answer": choices.index(f" {answer}")}


def build_items(num_items: int, seed: int = 0) -> list[dict[str, Any]]:
    """`num_items` items ({"question", "choices", "answer": index}), the same list for the same arguments."""
    rng = random.Random(seed)
    makers = [_arithmetic, _sequence, _comparison]
    return [makers[i % len(makers)](rng) for i in range(num_items)]


def write_task(out_dir: Path, num_items: int, seed: int = 0) -> Path:
    """Write the items and the task's YAML under `out_dir`; returns the directory to pass as include_path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = out_dir / f"{TASK_NAME}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in build_items(num_items, seed)))
    # JSON is a subset of YAML: json.dumps quotes the path whatever characters it holds.
    (out_dir / f"{TASK_NAME}.yaml").write_text(f"""task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data.resolve()))}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return out_dir
