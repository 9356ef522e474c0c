"""JSON Schemas the structured-output tests serve (a spread of what clients send: flat and nested objects,
arrays, enums, consts, patterns, formats, ranges, unions, $defs and $ref, optional properties). Strings and
arrays are bounded so that even a random model's document ends well within max_tokens."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 16}  # a short string
INT = {"type": "integer", "minimum": -1000, "maximum": 1000}


def obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required, "additionalProperties": False}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 130}}),
    "booleans": obj({"ok": {"type": "boolean"}, "done": {"type": "boolean"}}),
    "null_or_int": obj({"value": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    "enum": obj({"colour": {"enum": ["red", "green", "blue"]}}),
    "const": obj({"kind": {"const": "event"}, "id": INT}),
    "number_range": obj({"t": {"type": "number", "minimum": -50, "maximum": 50}}),
    "int_array": obj({"xs": {"type": "array", "items": INT, "minItems": 1, "maxItems": 4}}),
    "string_array": obj({"tags": {"type": "array", "items": S, "maxItems": 3}}),
    "nested": obj({"user": obj({"name": S, "address": obj({"city": S, "zip": {"type": "string",
                                                                              "pattern": "^[0-9]{5}$"}})})}),
    "array_of_objects": obj({"items": {"type": "array", "maxItems": 3,
                                       "items": obj({"sku": S, "qty": {"type": "integer", "minimum": 1,
                                                                       "maximum": 99}})}}),
    "pattern": obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}),
    "date_format": obj({"day": {"type": "string", "format": "date"}}),
    "uuid_format": obj({"id": {"type": "string", "format": "uuid"}}),
    "optional_property": obj({"a": INT, "b": S}, required=["a"]),
    "any_of": obj({"v": {"anyOf": [INT, {"type": "boolean"}]}}),
    "one_of_objects": obj({"shape": {"oneOf": [obj({"kind": {"const": "circle"}, "r": INT}),
                                               obj({"kind": {"const": "square"}, "side": INT})]}}),
    "defs_ref": {"$defs": {"point": obj({"x": INT, "y": INT})}, **obj({"a": {"$ref": "#/$defs/point"},
                                                                        "b": {"$ref": "#/$defs/point"}})},
    "string_length": obj({"s": {"type": "string", "minLength": 2, "maxLength": 5}}),
    "tuple_items": obj({"pair": {"type": "array", "prefixItems": [S, INT], "items": False}}),
    "deep": obj({"l1": obj({"l2": obj({"l3": obj({"leaf": {"type": "boolean"}})})})}),
    "many_fields": obj({f"f{i}": INT for i in range(8)}),
    "enum_array": obj({"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3}}),
    "top_level_array": {"type": "array", "items": INT, "minItems": 1, "maxItems": 3},
}
