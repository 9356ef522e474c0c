"""Aborts that came before their request: Ray does not keep one caller's call order for async actors, so a
small abort can overtake the (larger) submission it follows. The worker remembers the ids it was told to
abort, for a while, and refuses a submission that comes later under one of them.

    abort(request_id) → remember(request_id) (at most MAX_REMEMBERED, each for TTL_S; bounded as it is added)
    submit(request) → take(request_id): True → refused at once ("aborted"), nothing is held for it
"""

from __future__ import annotations

import time
from collections import OrderedDict

TTL_S = 120.0  # far longer than any submission spends on its way to the worker
MAX_REMEMBERED = 65536


class AbortedIds:
    def __init__(self, ttl_s: float = TTL_S, max_remembered: int = MAX_REMEMBERED) -> None:
        self.ttl_s = ttl_s
        self.max_remembered = max_remembered
        self._until: OrderedDict[str, float] = OrderedDict()  # request id → forgotten after (monotonic)

    def __len__(self) -> int:
        return len(self._until)

    def remember(self, request_id: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._until.pop(request_id, None)
        self._until[request_id] = now + self.ttl_s
        # Oldest first: drop the expired, and beyond the cap the oldest (a bound where ids are added).
        while self._until and (next(iter(self._until.values())) <= now
                               or len(self._until) > self.max_remembered):
            self._until.popitem(last=False)

    def take(self, request_id: str, now: float | None = None) -> bool:
        """Whether `request_id` was aborted (recently); it is forgotten either way."""
        until = self._until.pop(request_id, None)
        return until is not None and until > (time.monotonic() if now is None else now)
