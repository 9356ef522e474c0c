"""`response_format` → the grammar the output must follow (llm_engine.structured.GrammarSpec), checked here so
that a schema the grammar engine refuses is the client's 400 naming `response_format`, never a worker's error.

    text         → no grammar;
    json_object  → any JSON object;
    json_schema  → a document valid against `json_schema.schema`; `strict: true` allows no property or item
                   the schema does not name (without it, additional properties follow the schema's own rules).
"""

from __future__ import annotations

import functools

from gateway.api.bad_request import BadRequest
from gateway.api.protocol_tools import ResponseFormat
from llm_engine.structured import JSON_OBJECT_SCHEMA, GrammarError, GrammarSpec, check_grammar

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


def checked_grammar(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec`, once the grammar engine accepts it; else a 400 naming `param`."""
    if len(spec.json_schema) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"{param}: the schema is longer than {MAX_SCHEMA_CHARS} characters", param=param)
    problem = _problem(spec)
    if problem is not None:
        raise BadRequest(f"{param}: the grammar engine cannot use this schema: {problem}", param=param,
                         code="invalid_schema")
    return spec


@functools.lru_cache(maxsize=256)  # clients send the same few schemas again and again
def _problem(spec: GrammarSpec) -> str | None:
    try:
        check_grammar(spec)
    except GrammarError as error:
        return str(error)
    return None
