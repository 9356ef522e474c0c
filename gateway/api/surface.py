"""Which request fields pdserve honours, refuses and ignores: the one place that decides, so that nothing a
client sends is dropped in silence (docs/api.md's "Request fields" table lists the same).

    supported            declared on the request models (gateway/api/protocol.py, and vLLM's extensions in
                         gateway/api/protocol_extensions.py) and applied;
    ignored by design    declared too, and documented as having no effect here (`user`, `metadata`, `store`);
    not supported yet    known OpenAI fields whose effect pdserve cannot honour yet: a 400 naming the field,
                         unless the value asks for nothing (`suffix: null`, `functions: []`, ...);
    unknown              any other field: a 400 naming it (a typo must not silently change nothing).
The request models keep undeclared fields (`extra="allow"`) so that this check sees them and names them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.api.bad_request import BadRequest


def _absent(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Field → (does this value ask for nothing?, what a client should know).
NOT_YET_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "functions": (_absent, "function calling is not supported yet"),
    "function_call": (lambda v: v is None or v == "none", "function calling is not supported yet"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    # vLLM's older spellings, which it has replaced with structured_outputs: pdserve takes only the new one.
    "guided_json": (_absent, 'use structured_outputs: {"json": <schema>} (vLLM\'s current form)'),
    "guided_regex": (_absent, 'use structured_outputs: {"regex": ...} (vLLM\'s current form)'),
    "guided_choice": (_absent, 'use structured_outputs: {"choice": [...]} (vLLM\'s current form)'),
    "guided_grammar": (_absent, 'use structured_outputs: {"grammar": ...} (vLLM\'s current form)'),
    "prediction": (_absent, "predicted outputs are not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (_absent, "audio output is not supported"),
}
# On a chat message: what pdserve does not take in a history.
MESSAGE_NOT_YET_SUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "function_call": (lambda v: v is None, "function calling is not supported yet"),
    "refusal": (lambda v: v is None, "refusal messages are not supported"),
    "audio": (lambda v: v is None, "audio messages are not supported"),
}


def check_fields(extra: Mapping[str, Any] | None, where: str = "",
                 known: Mapping[str, tuple[Callable[[Any], bool], str]] = NOT_YET_SUPPORTED) -> None:
    """Raise BadRequest naming the first field of `extra` (a model's undeclared fields) that asks for
    something pdserve does not do; `where` prefixes the name (e.g. "messages[1].")."""
    for name, value in (extra or {}).items():
        param = f"{where}{name}"
        if name in known:
            asks_nothing, why = known[name]
            if not asks_nothing(value):
                raise BadRequest(f"{param}: {why}", param=param, code="unsupported_field")
            continue
        raise BadRequest(f"{param}: unknown field; pdserve does not support it (see docs/api.md, "
                         "\"Request fields\")", param=param, code="unsupported_field")
