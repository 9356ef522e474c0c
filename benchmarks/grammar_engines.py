"""xgrammar against llguidance on the default model's vocabulary (SmolLM2, 49152 tokens): which one the
engine uses for structured outputs is chosen by these figures (README, "Structured outputs").

For each schema: compile it (cold: a fresh compiler, then the same schema again), then walk the token path of
a valid document (the document tokenized by the model's tokenizer, then EOS) and time, at every step, filling
the next-token bitmask ([1, V/32] int32) and accepting the token. One thread, as a worker's sampler has.
Medians over --repeats walks; the same token path for both engines. llguidance builds its lexer lazily,
so part of its compile time shows in its first masks instead. Beside the times, the correctness check that
decided the choice: after `"a` inside a string with `maxLength`, may the next token be a raw control
character (U+000E, not allowed unescaped in JSON)?

    .venv/bin/pip install xgrammar   # not a pdserve dependency (llguidance is); pulls triton, ~1 GB
    .venv/bin/python benchmarks/grammar_engines.py [--repeats 5] [--out benchmarks/results/grammar_engines.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

# (name, schema or None for json_object, a valid document)
CASES: list[tuple[str, dict[str, Any] | None, Any]] = [
    ("json_object", None, {"city": "Paris", "temperature": 21.5, "tags": ["sunny", "dry"]}),
    ("flat", {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ("nested+enum", {
        "type": "object", "additionalProperties": False, "required": ["order", "status"],
        "properties": {
            "status": {"type": "string", "enum": ["open", "shipped", "closed"]},
            "order": {"type": "object", "additionalProperties": False, "required": ["id", "items"],
                      "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                     "items": {"type": "array", "minItems": 1, "items": {
                                         "type": "object", "additionalProperties": False,
                                         "required": ["sku", "qty"],
                                         "properties": {"sku": {"type": "string"},
                                                        "qty": {"type": "integer", "minimum": 1}}}}}}}},
     {"status": "open", "order": {"id": "ABC-1234", "items": [{"sku": "pen", "qty": 2},
                                                             {"sku": "ink", "qty": 1}]}}),
    ("long text", {"type": "object", "required": ["summary"], "additionalProperties": False,
                   "properties": {"summary": {"type": "string", "maxLength": 2000}}},
     {"summary": "The quick brown fox jumps over the lazy dog. " * 8}),
]


def _xgrammar(tokenizer: Any, vocab_size: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    def compile_(schema: dict[str, Any] | None, fresh: bool) -> Any:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=not fresh)
        # As the engine compiles them (llm_engine/structured.py): fixed separators, no free whitespace.
        return compiler.compile_json_schema(json.dumps(schema if schema is not None else {"type": "object"}),
                                            any_whitespace=False, strict_mode=schema is not None)

    def allows(schema: dict[str, Any], prefix: list[int], token: int) -> bool:
        matcher = xgr.GrammarMatcher(compile_(schema, fresh=True))
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        for t in prefix:
            assert matcher.accept_token(t)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    def walk(compiled: Any, tokens: list[int]) -> list[float]:
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.accept_token(token), token
        assert matcher.is_terminated()
        return times

    return compile_, walk, allows


def _llguidance(tokenizer: Any, vocab_size: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def compile_(schema: dict[str, Any] | None, fresh: bool) -> Any:
        del fresh  # nothing is cached across calls
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        # llguidance compiles lazily, inside the matcher: construction is its compile step.
        matcher = llguidance.LLMatcher(lltok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def allows(schema: dict[str, Any], prefix: list[int], token: int) -> bool:
        matcher = llguidance.LLMatcher(lltok, compile_(schema, fresh=True))
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        assert matcher.consume_tokens(prefix)
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    def walk(grammar: Any, tokens: list[int]) -> list[float]:
        matcher = llguidance.LLMatcher(lltok, grammar)
        bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        times = []
        for token in tokens:
            started = time.perf_counter()
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (token, matcher.get_error())
        assert matcher.is_stopped(), matcher.get_error()
        return times

    return compile_, walk, allows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/grammar_engines.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from llm_engine.default_model import prepare_default_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
    vocab_size = 49152
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engines = {"xgrammar": _xgrammar(tokenizer, vocab_size), "llguidance": _llguidance(tokenizer, vocab_size)}
    rows = []
    for name, schema, document in CASES:
        tokens = [*tokenizer.encode(json.dumps(document)), eos]
        for engine, (compile_, walk, _) in engines.items():
            started = time.perf_counter()
            compiled = compile_(schema, fresh=True)
            cold_ms = 1000 * (time.perf_counter() - started)
            step_ms, p99_ms = [], []
            for _ in range(args.repeats):
                times = sorted(walk(compiled, tokens))
                step_ms.append(1000 * statistics.median(times))
                p99_ms.append(1000 * times[min(len(times) - 1, int(0.99 * len(times)))])
            rows.append((name, engine, len(tokens), cold_ms, statistics.median(step_ms),
                         statistics.median(p99_ms)))
            print(f"{name:12s} {engine:10s} tokens {len(tokens):4d}  compile {cold_ms:8.1f} ms  "
                  f"mask/step median {rows[-1][4]:.3f} ms  p99 {rows[-1][5]:.3f} ms", flush=True)
    bounded = {"type": "string", "maxLength": 16}
    control = tokenizer.convert_tokens_to_ids("Ď")  # byte 0x0E in the byte-level vocabulary
    prefix = tokenizer.encode('"a')
    checks = {engine: allows(bounded, prefix, control) for engine, (_, _, allows) in engines.items()}
    print("raw control character allowed in a maxLength string:", checks)
    lines = [
        "# Grammar engines: per-step mask time on SmolLM2's vocabulary (49152 tokens)",
        "",
        f"`benchmarks/grammar_engines.py`, {datetime.now(UTC):%Y-%m-%d}, {platform.processor() or 'cpu'}, "
        f"1 thread, medians of {args.repeats} walks over a valid document's tokens (+ EOS).",
        "",
        "| schema | engine | tokens | compile (cold) ms | mask/step median ms | mask/step p99 ms |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | {e} | {t} | {c:.1f} | {m:.3f} | {p:.3f} |" for n, e, t, c, m, p in rows),
        "",
        "Raw control character (U+000E) allowed inside a `maxLength` string (invalid JSON if yes): "
        + ", ".join(f"{engine}: {'yes' if allowed else 'no'}" for engine, allowed in checks.items()),
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
