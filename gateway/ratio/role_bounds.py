"""How many workers may serve each role under `--scale auto` (`--min/--max-prefill-workers`,
`--min/--max-decode-workers`): the scale controller's candidate layouts are the ones these bounds allow
(gateway/ratio/sizing.py), and the settings refuse a starting layout outside them (gateway/config.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tuner.simulator import Layout


@dataclass(frozen=True)
class RoleBounds:
    """--min/--max-prefill-workers and --min/--max-decode-workers: how many workers may serve each role. A
    mixed worker serves both, so it counts for both: `--max-prefill-workers 1` allows 1 prefill + 3 decode,
    or 1 mixed + 3 decode, but not 2 mixed."""

    min_prefill: int = 0
    max_prefill: int | None = None
    min_decode: int = 0
    max_decode: int | None = None

    def __post_init__(self) -> None:
        for role, low, high in (("prefill", self.min_prefill, self.max_prefill),
                                ("decode", self.min_decode, self.max_decode)):
            if low < 0 or (high is not None and high < 1):
                raise ValueError(f"--min-{role}-workers must be >= 0 and --max-{role}-workers >= 1, got "
                                 f"{low} and {high}")
            if high is not None and low > high:
                raise ValueError(f"--min-{role}-workers {low} is above --max-{role}-workers {high}")

    @property
    def is_set(self) -> bool:
        return self != RoleBounds()

    def allows(self, layout: Layout) -> bool:
        return self.allows_counts(layout.prefill, layout.decode, layout.mixed)

    def allows_counts(self, num_prefill: int, num_decode: int, num_mixed: int) -> bool:
        prefill, decode = num_prefill + num_mixed, num_decode + num_mixed
        return (self.min_prefill <= prefill and (self.max_prefill is None or prefill <= self.max_prefill)
                and self.min_decode <= decode and (self.max_decode is None or decode <= self.max_decode))

    def describe(self) -> str:
        """The bounds as their flags, for errors and the decision log."""
        flags = [f"--min-prefill-workers {self.min_prefill}" if self.min_prefill else "",
                 f"--max-prefill-workers {self.max_prefill}" if self.max_prefill is not None else "",
                 f"--min-decode-workers {self.min_decode}" if self.min_decode else "",
                 f"--max-decode-workers {self.max_decode}" if self.max_decode is not None else ""]
        return " ".join(flag for flag in flags if flag) or "no per-role bounds"

    def summary(self) -> dict[str, int | None]:
        return {"min_prefill": self.min_prefill, "max_prefill": self.max_prefill,
                "min_decode": self.min_decode, "max_decode": self.max_decode}
