"""The roles a worker can serve in."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    PREFILL = "prefill"  # prefills prompts and offers their KV to decode workers
    DECODE = "decode"  # pulls prefilled KV and generates
    MIXED = "mixed"  # prefills its own requests and generates them (the colocated layout)

    @property
    def can_prefill(self) -> bool:
        """Whether requests can start here (a decode worker prefills only as a fallback)."""
        return self is not Role.DECODE

    @property
    def can_decode(self) -> bool:
        return self is not Role.PREFILL
