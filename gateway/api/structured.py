"""`response_format` and `structured_outputs` → the grammar the output must follow (GrammarSpec, in
llm_engine/structured.py), checked here so that a grammar the engine refuses is the client's 400 naming the
field, never a worker's error.

    text         → no grammar;
    json_object  → any JSON object;
    json_schema  → a document valid against `json_schema.schema`; `strict: true` allows no property or item
                   the schema does not name (without it, additional properties follow the schema's own rules).
vLLM's `structured_outputs` (exactly one kind), the same engine:
    json (a schema, or its JSON text) → as json_schema; strict when disable_additional_properties;
    json_object → any JSON object;  regex / choice / grammar (Lark or GBNF) → llguidance compiles them.
"""

from __future__ import annotations

import functools
import json

from gateway.api.bad_request import BadRequest
from gateway.api.protocol_extensions import StructuredOutputs
from gateway.api.protocol_tools import ResponseFormat
from llm_engine.structured import JSON_OBJECT_SCHEMA, GrammarError, GrammarKind, GrammarSpec, check_grammar

MAX_SCHEMA_CHARS = 64 * 1024  # a schema's JSON text: compiling grows with it, and real ones are far smaller


def response_format_grammar(response_format: ResponseFormat | None) -> GrammarSpec | None:
    """The grammar `response_format` asks for; None for text. Raises BadRequest naming the field."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarSpec(JSON_OBJECT_SCHEMA, strict=False)
    if response_format.json_schema is None:
        raise BadRequest("response_format: type json_schema needs a json_schema object",
                         param="response_format")
    fmt = response_format.json_schema
    spec = GrammarSpec.of_schema(fmt.json_schema, strict=bool(fmt.strict))
    checked_grammar(spec, "response_format")
    return spec


def structured_outputs_grammar(outputs: StructuredOutputs | None) -> GrammarSpec | None:
    """The grammar vLLM's `structured_outputs` asks for; None when absent. Raises BadRequest naming the
    field."""
    if outputs is None:
        return None
    param = "structured_outputs"
    for option in ("whitespace_pattern", "structural_tag"):
        if getattr(outputs, option) is not None:
            raise BadRequest(f"{param}.{option}: not supported (pdserve writes JSON without free whitespace, "
                             "and has no structural tags)", param=f"{param}.{option}",
                             code="unsupported_field")
    kinds = {"json": outputs.json_schema is not None, "json_object": bool(outputs.json_object),
             "regex": outputs.regex is not None, "choice": outputs.choice is not None,
             "grammar": outputs.grammar is not None}
    chosen = [name for name, is_set in kinds.items() if is_set]
    if len(chosen) != 1:
        raise BadRequest(f"{param}: give exactly one of json, json_object, regex, choice and grammar"
                         f"{f' (got {chosen})' if chosen else ''}", param=param)
    kind = chosen[0]
    if kind == "json_object":
        return GrammarSpec(JSON_OBJECT_SCHEMA, strict=False)
    if kind == "json":
        schema = outputs.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise BadRequest(f"{param}.json: not a JSON schema ({error})",
                                 param=f"{param}.json") from None
        if not isinstance(schema, dict):
            raise BadRequest(f"{param}.json: a JSON schema must be an object", param=f"{param}.json")
        spec = GrammarSpec.of_schema(schema, strict=outputs.disable_additional_properties)
    elif kind == "regex":
        spec = GrammarSpec.of_text(GrammarKind.REGEX, outputs.regex or "")
    elif kind == "choice":
        spec = GrammarSpec.of_text(GrammarKind.CHOICE, json.dumps(outputs.choice, ensure_ascii=False))
    else:
        spec = GrammarSpec.of_text(GrammarKind.GRAMMAR, outputs.grammar or "")
    return checked_grammar(spec, f"{param}.{kind}")


def checked_grammar(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec`, once the grammar engine accepts it; else a 400 naming `param`."""
    if len(spec.json_schema) + len(spec.source) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"{param}: the schema is longer than {MAX_SCHEMA_CHARS} characters", param=param)
    problem = _problem(spec)
    if problem is not None:
        what = "schema" if spec.kind is GrammarKind.JSON_SCHEMA else spec.kind.value
        raise BadRequest(f"{param}: the grammar engine cannot use this {what}: {problem}", param=param,
                         code="invalid_schema")
    return spec


@functools.lru_cache(maxsize=256)  # clients send the same few schemas again and again
def _problem(spec: GrammarSpec) -> str | None:
    try:
        check_grammar(spec)
    except GrammarError as error:
        return str(error)
    return None
