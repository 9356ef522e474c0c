"""What a structured output must look like (GrammarSpec, part of SamplingParams), and its grammar compiled
for a vocabulary, cached per schema.

The grammar engine is llguidance. xgrammar's per-step mask was faster on SmolLM2's 49152-token vocabulary
(median 1-8 µs against 10-27 µs in the latest run; benchmarks/README.md), but both are far below a decode step
(tens of ms here), and xgrammar 0.2.9 lets a string with `maxLength` hold raw control characters, which is not
JSON: outputs of valid-looking schemas failed to parse. llguidance keeps JSON strings JSON, and does not pull
triton (~1 GB) into a CPU install. It is imported only when a request asks for a grammar.

    gateway:  GrammarSpec from response_format / tool_choice → check_grammar (a schema the engine rejects is
              a 400 there, before any worker sees it);
    worker:   GrammarCache.hold(spec) at submission, on a thread of its own: a matcher built once per schema
              for this vocabulary (LRU, per worker process), kept with the request's spec for as long as the
              request lives here → a deep copy of it per registration (llm_engine/grammar_mask.py: at
              admission, and again after a preemption or a move), never a compilation on the step thread
              however many grammars have been evicted from the LRU meanwhile (review P5).
"""

from __future__ import annotations

import enum
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import llguidance

MAX_CACHED_GRAMMARS = 64  # compiled grammars kept per worker process
_HELD = "_held_matcher"  # a GrammarSpec's attribute: its compiled matcher, held for its request (hold())
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object
# Fixed separators, no free whitespace: a model (a random one certainly) could otherwise write blanks forever
# and never close the document.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarKind(enum.Enum):
    """What a GrammarSpec's text is (vLLM's structured_outputs kinds beside JSON)."""

    JSON_SCHEMA = "json_schema"  # `json_schema`, with `strict`, `prefix` and `suffix`
    REGEX = "regex"  # `source` is a regular expression (Rust `regex` syntax) the whole output matches
    CHOICE = "choice"  # `source` is a JSON list of strings: the output is one of them
    GRAMMAR = "grammar"  # `source` is a Lark grammar (llguidance's dialect) or a GBNF one


@dataclass(frozen=True)
class GrammarSpec:
    """Text the output must be, then EOS: for JSON_SCHEMA, `prefix`, then a JSON document valid against
    `json_schema`, then `suffix`; for the other kinds, what `source` describes. Hashable: it is the
    compiled-grammar cache's key."""

    json_schema: str  # the JSON Schema as JSON text; JSON_OBJECT_SCHEMA: any object ("" for other kinds)
    strict: bool = True  # objects take no properties beyond those they name (OpenAI's `strict`)
    prefix: str = ""  # literal text before the document (a tool-call parser's opening tag)
    suffix: str = ""  # literal text after it
    kind: GrammarKind = GrammarKind.JSON_SCHEMA
    source: str = ""  # the regex, choices or grammar of the other kinds

    def __getstate__(self) -> dict[str, Any]:
        # The matcher a worker holds with the spec (GrammarCache.hold) stays in that process.
        return {k: v for k, v in self.__dict__.items() if k != _HELD}

    @classmethod
    def of_text(cls, kind: GrammarKind, source: str) -> GrammarSpec:
        """A regex, choice or grammar spec (not JSON_SCHEMA)."""
        return cls("", kind=kind, source=source)

    @classmethod
    def of_schema(cls, schema: dict[str, Any], strict: bool = True, prefix: str = "", suffix: str = ""
                  ) -> GrammarSpec:
        # Key order is kept: it is the order the grammar writes properties in.
        return cls(json.dumps(schema, ensure_ascii=False), strict, prefix, suffix)


class GrammarError(ValueError):
    """The grammar engine cannot build this grammar (an unsupported or inconsistent schema)."""


def _closed(schema: Any) -> Any:
    """strict: every object schema that names properties and says nothing of others allows none."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def build_grammar(spec: GrammarSpec) -> str:
    """The spec as an llguidance grammar (its serialised form), not yet bound to a vocabulary.

    Raises:
        GrammarError: the schema is not a JSON object or llguidance refuses it (the message says why).
    """
    import llguidance

    if spec.kind is not GrammarKind.JSON_SCHEMA:
        try:
            grammar = llguidance.grammar_from(spec.kind.value, spec.source)
        except Exception as error:  # a GBNF that does not convert, a bad choice list: the client's input
            raise GrammarError(str(error)) from None
        problem = llguidance.LLMatcher.validate_grammar(grammar)
        if problem:
            raise GrammarError(problem)
        return grammar
    try:
        schema = json.loads(spec.json_schema)
    except json.JSONDecodeError as error:
        raise GrammarError(f"the schema is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise GrammarError("the schema must be a JSON object")
    schema = {**(_closed(schema) if spec.strict else schema), "x-guidance": JSON_OPTIONS}
    if spec.prefix or spec.suffix:
        lark = (f"start: {json.dumps(spec.prefix) if spec.prefix else ''} document "
                f"{json.dumps(spec.suffix) if spec.suffix else ''}\ndocument: %json {json.dumps(schema)}\n")
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(problem)
    return grammar


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError when the grammar engine would refuse the spec (no vocabulary needed)."""
    build_grammar(spec)


class GrammarCache:
    """Matchers in their start state, one per grammar, for one vocabulary (least recently used go first)."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: Sequence[int],
                 max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size  # the model's logits width (may exceed the tokenizer's vocabulary)
        self.stop_token_ids = list(stop_token_ids)
        self.max_entries = max_entries
        self._compiled: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self.num_compiled = 0  # compilations done (cache misses)
        self._lock = threading.Lock()  # the step thread and the compiling thread share the cache

    def _get_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            # The grammar's end is the model's EOS; a model whose config names none ends on the tokenizer's
            # (the gateway makes that token a stop token of such requests).
            eos = self.stop_token_ids[0] if self.stop_token_ids else tokenizer.eos_token_id
            self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,  # type: ignore[arg-type]
                                                           eos_token=eos)
        return self._tokenizer

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The spec's matcher in its start state, compiled once (cached). Safe from any thread: a worker
        compiles a request's grammar on a thread of its own before the request reaches the step loop, so
        that the loop (every stream of the worker) never waits for a compilation. Raises GrammarError."""
        import llguidance

        with self._lock:
            found = self._compiled.get(spec)
            if found is not None:
                self._compiled.move_to_end(spec)
                return found
            tokenizer = self._get_tokenizer()
        compiled = llguidance.LLMatcher(tokenizer, build_grammar(spec))  # outside the lock: it takes long
        if compiled.is_error():
            raise GrammarError(compiled.get_error())
        with self._lock:
            self.num_compiled += 1
            self._compiled[spec] = compiled
            if len(self._compiled) > self.max_entries:
                self._compiled.popitem(last=False)
        return compiled

    def hold(self, spec: GrammarSpec) -> None:
        """Compile the request's spec (or find it cached) and keep the matcher with this spec object, which
        lives as long as its request on this worker: matcher() then never compiles for it, whatever the LRU
        evicts. Raises GrammarError."""
        object.__setattr__(spec, _HELD, self.compile(spec))

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher for `spec`: a copy of the one held with it, else of the cached one (compiled
        here if it is not cached: a spec that did not come through the worker's submission). Raises
        GrammarError."""
        held: llguidance.LLMatcher | None = spec.__dict__.get(_HELD)
        return (held if held is not None else self.compile(spec)).deep_copy()

    def __len__(self) -> int:
        return len(self._compiled)
