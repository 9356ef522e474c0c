"""Command-line flags made from a pydantic-settings model: one source for flags, environment and YAML.

Each field `some_field` becomes `--some-field` (its description the help, its default shown beside it), and
the model's env_prefix gives it an environment variable (`PDSERVE_SOME_FIELD`). Argparse defaults stay None,
so a flag not given is absent and the lower layers show through: flags > environment > YAML > defaults.
A bool field becomes `--x/--no-x`; a dict field takes JSON; every other value is parsed by its own type
(int, float) or handed to pydantic as text (Literal choices), whose error then names the flag.
"""

from __future__ import annotations

import argparse
import json
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

PRECEDENCE = "flags > environment > YAML (--config) > defaults"


def json_object(text: str) -> dict[str, Any]:
    """A JSON object given on the command line (argparse names this function in its error)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(model: type[BaseSettings], field: str) -> str:
    return f"{model.model_config.get('env_prefix', '')}{field}".upper()


def _value_type(annotation: Any) -> Any:
    """The annotation without None: `int | None` → int."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return annotation


def _default_text(info: FieldInfo) -> str:
    default = info.default
    if default is None:
        return ""  # the description says in words what None means (tests/gateway/test_settings_cli.py)
    if isinstance(default, bool):
        return " (default: on)" if default else " (default: off)"
    if isinstance(default, float) and math.isinf(default):
        return " (default: inf)"
    if isinstance(default, list | tuple):
        default = " ".join(str(item) for item in default) if default else "none"
    return f" (default: {default})"


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseSettings],
                    aliases: Mapping[str, Sequence[str]] | None = None) -> None:
    """One flag per field of `model`.

    Args:
        aliases: field → more flags beside `--field-name`, shown in the help.
    """
    for field, info in model.model_fields.items():
        kind = _value_type(info.annotation)
        origin = typing.get_origin(kind) or kind
        options: dict[str, Any] = {"dest": field, "default": None}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif origin is dict:
            options["type"] = json_object
        elif origin in (list, tuple):
            options["nargs"] = "+"
        elif kind in (int, float):
            options["type"] = kind
        elif origin is typing.Literal:  # shown as choices; pydantic checks them (its error names the flag)
            options["metavar"] = "{" + ",".join(str(c) for c in typing.get_args(kind)) + "}"
        help_text = (info.description or "") + _default_text(info) + f" [env {env_name(model, field)}]"
        flags = [flag_name(field), *(aliases or {}).get(field, ())]
        parser.add_argument(*flags, help=help_text.replace("%", "%%"), **options)


def given_flags(args: argparse.Namespace, model: type[BaseSettings]) -> dict[str, Any]:
    """The fields whose flag was given on the command line."""
    return {field: value for field in model.model_fields if (value := getattr(args, field, None)) is not None}


def error_message(error: ValidationError, source_of: Callable[[str], str]) -> str:
    """The first validation error, naming the flag (and where its value came from, if not a flag)."""
    first = error.errors()[0]
    message = str(first["msg"]).removeprefix("Value error, ")
    if not first["loc"]:  # a check across fields: its message names the flags
        return message
    field = str(first["loc"][0])
    source = source_of(field)
    return f"{flag_name(field)}: {message}" + (f" (from {source})" if source else "")


def layer_sources(model: type[BaseSettings], flags: Mapping[str, Any], env: Mapping[str, Any],
                  yaml_path: str | None) -> Callable[[str], str]:
    """Where a field's value came from, for error messages: "" (a flag), the env var, or the YAML file."""

    def source_of(field: str) -> str:
        if field in flags:
            return ""
        if field in env:
            return env_name(model, field)
        return yaml_path or ""

    return source_of


def env_defaults(parser: argparse.ArgumentParser, prefix: str) -> None:
    """The same contract for a hand-written parser (`pdserve tune`): each flag's default may come from
    `<prefix><DEST>` (flags > environment > defaults), and its help shows the default and that variable."""
    import os

    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if action.dest in ("help", argparse.SUPPRESS) or action.help == argparse.SUPPRESS:
            continue
        name = f"{prefix}{action.dest}".upper()
        if name in os.environ:
            text = os.environ[name]
            if action.nargs == 0:  # a switch: store_true and the like
                action.default = text.strip().lower() in ("1", "true", "yes", "on")
            else:
                action.default = text  # argparse parses a string default with the flag's type
            action.required = False
        default = "unset" if action.default is None else action.default
        shown = "" if "default" in (action.help or "") else f" (default: {default})"
        action.help = f"{action.help or ''}{shown} [env {name}]".replace("%)", "%%)")
