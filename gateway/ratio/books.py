"""RoutingBooks: the router's counts that the ratio controller and the resizer read, wherever the routers are.

Each frontend has its own router (gateway/requests/router.py); the fleet actor sums what they report
(gateway/control/reported_books.py), and its controller and resizer read those sums. The controller also sets
the routers' local-prefill policy through them: each frontend's router takes it from the fleet. (A Router
provides them too: the unit tests drive a controller with one.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from gateway.requests.router import LocalPrefillPolicy


class RoutingBooks(Protocol):
    local_prefill: LocalPrefillPolicy
    on_local_prefill: list[Callable[[int], None]]  # called with a prompt's tokens as a worker that decodes
                                                   # starts prefilling it for itself

    @property
    def prefill_tokens(self) -> Mapping[str, int]:
        """Prompt tokens sent to each prefill worker and not yet prefilled."""
        ...

    @property
    def local_prefill_tokens(self) -> Mapping[str, int]:
        """Prompt tokens each decode or mixed worker was sent to prefill itself, not yet prefilled."""
        ...

    def in_flight(self, worker_id: str) -> int:
        """Tokens of requests sent to the worker and not yet back (0: nothing on its way there)."""
        ...

    def on_the_way(self, worker_id: str) -> str:
        """Which requests in_flight counts, and where each is now (what a drain still waits for)."""
        ...

    def longest_local_prefill(self) -> int: ...

    def longest_prefill_beside_streams(self) -> int: ...
