"""What a structured output must look like (GrammarSpec, part of SamplingParams), and its grammar compiled
for a vocabulary, cached per schema.

The grammar engine is xgrammar: on SmolLM2's 49152-token vocabulary its per-step mask took 1-8 µs (median)
against llguidance's 8-28 µs, and its p99 6-34 µs against 59-116 µs (benchmarks/results/grammar_engines.md).
It is imported only when a request asks for a grammar, so workers that never see one never load it.

    gateway:  GrammarSpec from response_format / tool_choice → check_grammar (a schema the engine rejects is
              a 400 there, before any worker sees it);
    worker:   GrammarCache.compiled(spec) → xgrammar CompiledGrammar (LRU, per worker process)
              → one GrammarMatcher per request (llm_engine/grammar_mask.py).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per worker process (each a few hundred KiB to a few MiB)
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object


@dataclass(frozen=True)
class GrammarSpec:
    """Text the output must be: `prefix`, then a JSON document valid against `json_schema`, then `suffix`,
    then EOS. Hashable: it is the compiled-grammar cache's key."""

    json_schema: str  # the JSON Schema as JSON text; JSON_OBJECT_SCHEMA: any object
    strict: bool = True  # no properties or items beyond those the schema names (OpenAI's `strict`)
    prefix: str = ""  # literal text before the document (a tool-call parser's opening tag)
    suffix: str = ""  # literal text after it

    @classmethod
    def of_schema(cls, schema: dict[str, Any], strict: bool = True, prefix: str = "", suffix: str = ""
                  ) -> GrammarSpec:
        # Key order is kept: it is the order the grammar writes properties in.
        return cls(json.dumps(schema, ensure_ascii=False), strict, prefix, suffix)


class GrammarError(ValueError):
    """The grammar engine cannot build this grammar (an unsupported or inconsistent schema)."""


def _ebnf_literal(text: str) -> str:
    return 'root ::= "' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def build_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The spec as an xgrammar Grammar, not yet compiled for a vocabulary.

    Raises:
        GrammarError: the schema is not JSON or xgrammar refuses it (the message says why).
    """
    import xgrammar as xgr

    try:
        # Fixed separators, no free whitespace: a model (a random one certainly) could otherwise emit blanks
        # forever and never close the document.
        document = xgr.Grammar.from_json_schema(spec.json_schema, any_whitespace=False,
                                                strict_mode=spec.strict)
        parts = [xgr.Grammar.from_ebnf(_ebnf_literal(t)) if t else None for t in (spec.prefix, spec.suffix)]
    except (RuntimeError, ValueError, TypeError) as error:
        # xgrammar's messages start with a timestamp and its C++ source position: keep what follows.
        raise GrammarError(re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(error).strip())) from None
    if parts[0] is None and parts[1] is None:
        return document
    return xgr.Grammar.concat(*[g for g in (parts[0], document, parts[1]) if g is not None])


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError when the grammar engine would refuse the spec (no vocabulary needed)."""
    build_grammar(spec)


class GrammarCache:
    """Compiled grammars of one worker process for one vocabulary, least recently used dropped first."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._compiled: OrderedDict[GrammarSpec, xgrammar.CompiledGrammar] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.num_compiled = 0  # compilations done (cache misses)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            # A model whose config names no EOS: the tokenizer's (matchers override it per request).
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            # One thread: the worker's cores belong to its forward. Our own LRU bounds what is kept.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compiled(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        """The spec compiled for this vocabulary. Raises GrammarError (the gateway checks specs first)."""
        found = self._compiled.get(spec)
        if found is not None:
            self._compiled.move_to_end(spec)
            return found
        compiled = self._get_compiler().compile_grammar(build_grammar(spec))
        self.num_compiled += 1
        self._compiled[spec] = compiled
        if len(self._compiled) > self.max_entries:
            self._compiled.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)
