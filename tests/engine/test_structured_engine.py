"""Structured outputs in the engine alone (tiny random Llama with SmolLM2's tokenizer): the grammar mask
makes every output a valid document that ends at the grammar's end (EOS), whatever the weights; a matcher
rebuilt from the tokens so far (what a decode worker or a migration target does) continues exactly as the
original; the compiled-grammar cache is bounded and reused; a schema llguidance refuses is a GrammarError."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from llm_engine import SamplingParams
from llm_engine.batch import TokenHistory
from llm_engine.grammar_mask import GrammarMask
from llm_engine.logits_processors import SamplingRows
from llm_engine.structured import GrammarCache, GrammarError, GrammarKind, GrammarSpec, check_grammar
from tests.conftest import random_prompts
from tests.engine.test_engine_correctness import make_engine

SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
    "properties": {"name": {"type": "string", "maxLength": 12},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}},
}
EOS = 2  # SmolLM2's <|im_end|>; the tiny model's config names no EOS: requests name it (as the gateway does)


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir: Path) -> Any:
    return make_engine(tiny_chat_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_is_a_valid_document_ending_at_eos(engine: Any, tokenizer: Any, temperature: float
                                                        ) -> None:
    prompts = random_prompts([5, 17, 30, 9], 49152, seed=3)
    params = SamplingParams(max_tokens=200, temperature=temperature, seed=7, stop_token_ids=(EOS,),
                            grammar=GrammarSpec.of_schema(SCHEMA))
    for completion in engine.generate(prompts, params):
        assert completion.finish_reason == "stop"
        assert completion.output_token_ids[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(completion.output_token_ids[:-1])), SCHEMA)
    engine.generate(prompts[:1], SamplingParams(max_tokens=1))  # the runner hears of them with a next forward
    assert engine.runner.grammar_mask.num_matchers == 0  # forgotten with their tables


def test_prefix_and_suffix_surround_the_document(engine: Any, tokenizer: Any) -> None:
    spec = GrammarSpec.of_schema(SCHEMA, prefix="<tool_call>\n", suffix="\n</tool_call>")
    params = SamplingParams(max_tokens=200, temperature=0, stop_token_ids=(EOS,), grammar=spec)
    [completion] = engine.generate(random_prompts([12], 49152), params)
    text = tokenizer.decode(completion.output_token_ids[:-1])
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    jsonschema.validate(json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")), SCHEMA)


def test_a_matcher_rebuilt_from_the_tokens_so_far_continues_as_the_original(
        engine: Any, tiny_chat_model_dir: Path) -> None:
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=11, stop_token_ids=(EOS,),
                            grammar=GrammarSpec.of_schema(SCHEMA))
    prompt = random_prompts([20], 49152, seed=5)[0]
    [whole] = engine.generate([prompt], params)
    # A second mask replays the first k tokens (as a decode worker after a migration) and must allow the
    # same tokens as the first one did at step k, so the seeded stream goes on identically.
    cache = GrammarCache(str(tiny_chat_model_dir), 49152, (EOS,))
    for k in (1, len(whole.output_token_ids) // 2):
        replayed = GrammarMask(cache)
        replayed.register("r", params, TokenHistory(tuple(prompt), whole.output_token_ids[:k]))
        logits = torch.zeros(1, 49152)
        replayed.apply(logits, SamplingRows(("r",), (params,), (k,)))
        assert logits[0, whole.output_token_ids[k]] == 0.0
        allowed = set(torch.nonzero(logits[0] == 0.0)[:, 0].tolist())
        fresh = GrammarMask(cache)
        fresh.register("r", params, TokenHistory(tuple(prompt), ()))
        for token in whole.output_token_ids[:k]:
            fresh.record(SamplingRows(("r",), (params,), (0,)), torch.tensor([token]))
        expected = torch.zeros(1, 49152)
        fresh.apply(expected, SamplingRows(("r",), (params,), (k,)))
        assert allowed == set(torch.nonzero(expected[0] == 0.0)[:, 0].tolist())
    assert cache.num_compiled == 1


def test_the_cache_is_bounded_and_reused(tiny_chat_model_dir: Path) -> None:
    cache = GrammarCache(str(tiny_chat_model_dir), 49152, (EOS,), max_entries=2)
    specs = [GrammarSpec.of_schema({"type": "object", "properties": {f"k{i}": {"type": "integer"}}})
             for i in range(3)]
    cache.matcher(specs[0])
    cache.matcher(specs[0])
    assert cache.num_compiled == 1
    cache.matcher(specs[1])
    cache.matcher(specs[2])
    assert len(cache) == 2 and cache.num_compiled == 3
    cache.matcher(specs[0])  # evicted as the least recently used: compiled again
    assert cache.num_compiled == 4


@pytest.mark.parametrize("schema", ['{"type": "frob"}', '{"properties": {"a": {"$ref": "#/nowhere"}}}',
                                    "not json"])
def test_a_schema_the_engine_refuses_is_a_grammar_error(schema: str) -> None:
    with pytest.raises(GrammarError) as raised:
        check_grammar(GrammarSpec(schema))
    assert str(raised.value)


@pytest.mark.parametrize(("kind", "source", "matches"), [
    (GrammarKind.REGEX, r"[a-c]{2,4}-[0-9]", lambda text: re.fullmatch(r"[a-c]{2,4}-[0-9]", text)),
    (GrammarKind.CHOICE, json.dumps(["red", "green", "blue sky"]), lambda text: text in {"red", "green",
                                                                                          "blue sky"}),
    (GrammarKind.GRAMMAR, 'start: "x" ("y" | "zz")+', lambda text: re.fullmatch(r"x(y|zz)+", text)),
    (GrammarKind.GRAMMAR, 'root ::= "ab" [0-9]', lambda text: re.fullmatch(r"ab[0-9]", text)),  # GBNF
])
def test_regex_choice_and_grammar_outputs_match(engine: Any, tokenizer: Any, kind: GrammarKind, source: str,
                                                matches: Any) -> None:
    """vLLM's structured_outputs kinds beside JSON, sampled freely: every output is the grammar's text."""
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2, stop_token_ids=(EOS,),
                            grammar=GrammarSpec.of_text(kind, source))
    for completion in engine.generate(random_prompts([8, 15, 23], 49152, seed=9), params):
        assert completion.finish_reason == "stop" and completion.output_token_ids[-1] == EOS
        assert matches(tokenizer.decode(completion.output_token_ids[:-1])), completion
    assert engine.block_pool.is_whole()
