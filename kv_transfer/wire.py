"""msgpack codec for the frozen dataclasses that cross a process boundary.

Every message in this package is a frozen dataclass whose fields are plain values (int, float, str, bytes,
bool), enums, tuples of those, nested message dataclasses, or `X | None`. `encode` walks the fields by name,
`decode` rebuilds the class from its type hints, so a message needs no hand-written (de)serialiser.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


def encode(message: Any) -> bytes:
    """Serialise a message dataclass to msgpack bytes.

    Args:
        message: an instance of a frozen dataclass from this package.

    Returns:
        The msgpack bytes.
    """
    return msgpack.packb(_to_plain(message), use_bin_type=True)


def decode(cls: type[T], data: bytes) -> T:
    """Rebuild a message dataclass from msgpack bytes written by `encode`.

    Args:
        cls: the dataclass to rebuild.
        data: msgpack bytes.

    Returns:
        The message instance.
    """
    return typing.cast(T, _from_plain(cls, msgpack.unpackb(data, raw=False)))


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_to_plain(v) for v in value]
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # Resolved once per class: with `from __future__ import annotations` the annotations are strings.
    return typing.get_type_hints(cls)


def _from_plain(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return _from_plain(inner, value)
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_from_plain(item_tp, v) for v in value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        return tp(**{name: _from_plain(hints[name], v) for name, v in value.items()})
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if tp is float and isinstance(value, int):
        return float(value)
    return value
