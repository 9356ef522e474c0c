"""Ray's errors translated in one place (gateway/fleet/ray_calls.py), as the worker and fleet clients use it;
no Ray cluster: the errors are built here."""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError, RayTaskError

from gateway.fleet.ray_calls import translated


def task_error(cause: BaseException) -> RayTaskError:
    return RayTaskError("method", "traceback", cause)


async def raising(error: BaseException) -> None:
    raise error


def run(error: BaseException) -> None:
    def from_cause(cause: BaseException) -> BaseException | None:
        if isinstance(cause, KeyError):
            return cause  # raised as itself
        return ConnectionError(f"failed: {cause}") if isinstance(cause, RuntimeError) else None

    asyncio.run(translated(raising(error), lambda gone: LookupError(type(gone).__name__), from_cause))


def test_a_dead_actor_a_translated_cause_and_an_untranslated_one() -> None:
    with pytest.raises(LookupError, match="RayActorError"):
        run(RayActorError())
    with pytest.raises(KeyError, match="w-9"):
        run(task_error(KeyError("w-9")))
    with pytest.raises(ConnectionError, match="failed: step loop died"):
        run(task_error(RuntimeError("step loop died")))
    with pytest.raises(RayTaskError):
        run(task_error(ValueError("other")))
    with pytest.raises(ValueError, match="not Ray's"):  # anything else raises as it is
        run(ValueError("not Ray's"))
