"""Awaiting a Ray actor call with its errors translated: the one place that inspects a RayActorError or a
RayTaskError (the worker client and the fleet client each say what they become)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from ray.exceptions import RayActorError, RayTaskError

T = TypeVar("T")


async def translated(call: Awaitable[T], when_gone: Callable[[RayActorError], BaseException],
                     from_cause: Callable[[BaseException], BaseException | None]) -> T:
    """`call`'s result.

    Args:
        when_gone: what an actor that died (or is restarting) raises instead.
        from_cause: what a method that raised raises instead, from its own exception; None: the RayTaskError
            itself.
    """
    try:
        return await call
    except RayActorError as error:
        raise when_gone(error) from error
    except RayTaskError as error:
        cause = getattr(error, "cause", None)
        replacement = from_cause(cause) if isinstance(cause, BaseException) else None
        if replacement is None:
            raise
        raise replacement from (None if replacement is cause else error)
