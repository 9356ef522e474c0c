"""The pools: how many workers of each role, the transfer backend, and the controllers that change them
(--ratio auto, --scale auto with its bounds, SLOs and profile)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator

from gateway.fleet.config import CANNOT_SERVE, can_serve
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.role_bounds import RoleBounds
from gateway.ratio.sizing import ScalePolicy
from worker_runtime.roles import Role

SCALE_BOUNDS = ("min_workers", "max_workers", "min_prefill_workers", "max_prefill_workers",
                "min_decode_workers", "max_decode_workers")  # flags that only --scale auto takes


class LayoutSettings(BaseModel):
    prefill: int | None = Field(
        None, ge=0,
        description="prefill workers (default: 1 when no role is given, else 0)")
    decode: int | None = Field(
        None, ge=0,
        description="decode workers (default: 1 when no role is given, else 0)")
    mixed: int | None = Field(
        None, ge=0,
        description="workers that prefill and decode their own requests (the colocated layout; default: 0)")
    backend: Literal["auto", "nixl", "torch", "local"] = Field(
        "auto",
        description="KV transfer backend: auto, nixl, torch or local")
    ratio: Literal["fixed", "auto"] = Field(
        "fixed",
        description="fixed, or auto: the ratio controller (gateway/ratio/controller.py) moves workers between"
                    " roles by load")
    scale: Literal["fixed", "auto"] = Field(
        "fixed",
        description="fixed, or auto: the scale controller (gateway/ratio/scaler.py) sets how many workers "
                    "there are, and their roles, from the traffic, between --min-workers and --max-workers "
                    "(needs --profile; where the cluster autoscales, with --autoscale-wait-s)")
    min_workers: int | None = Field(None, ge=1, description="--scale auto: the fewest workers (default: 1)")
    max_workers: int | None = Field(None, ge=1,
                                    description="--scale auto: the most workers (no default: it needs one)")
    min_prefill_workers: int | None = Field(
        None, ge=0, description="--scale auto: the fewest workers that prefill (a mixed worker counts; "
                                "default 0)")
    max_prefill_workers: int | None = Field(
        None, ge=1, description="--scale auto: the most workers that prefill (a mixed worker counts; "
                                "default: --max-workers)")
    min_decode_workers: int | None = Field(
        None, ge=0, description="--scale auto: the fewest workers that decode (a mixed worker counts; "
                                "default 0)")
    max_decode_workers: int | None = Field(
        None, ge=1, description="--scale auto: the most workers that decode (a mixed worker counts; "
                                "default: --max-workers)")
    scale_window_s: float = Field(
        ScalePolicy.window_s, gt=0, le=3600,
        description="--scale auto: the recent traffic, s, each plan replays on every size")
    scale_in_calm_s: float = Field(
        ScalePolicy.in_calm_s, gt=0, le=24 * 3600,
        description="--scale auto: how long every plan must name a smaller fleet before one worker is "
                    "drained (and again before the next)")
    ttft_slo_s: float = Field(
        ControllerPolicy.ttft_slo_s, gt=0,
        description="time-to-first-token target, s (the ratio controller's; bench and tune use the same name "
                    "and default)")
    itl_slo_s: float = Field(
        ControllerPolicy.itl_slo_s, gt=0,
        description="inter-token latency (TPOT) target, s")
    profile: str | None = Field(
        None,
        description="a worker's profile (pdserve tune profile): with --ratio auto, the controller also "
                    "replays the last minute's traffic through the simulator on every layout and moves toward"
                    " the one it predicts best (default: none, no planner)")

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, profile: str | None) -> str | None:
        if profile is not None and not Path(profile).is_file():
            raise ValueError(f"profile {profile!r} does not exist (make one with `pdserve tune profile`)")
        return profile

    @model_validator(mode="after")
    def _check_layout(self) -> Self:
        """The roles (none given: 1 prefill + 1 decode), the scale controller's bounds, a layout that
        serves."""
        if self.prefill is None and self.decode is None and self.mixed is None:
            self.prefill, self.decode = 1, 1
        self._check_scale()
        prefill, decode, mixed = self.prefill or 0, self.decode or 0, self.mixed or 0
        if not can_serve({Role.PREFILL: prefill, Role.DECODE: decode, Role.MIXED: mixed}):
            raise ValueError(f"--prefill/--decode/--mixed: {prefill} prefill + {decode} decode + {mixed} "
                             f"mixed {CANNOT_SERVE}")
        return self

    def role_bounds(self) -> RoleBounds:
        """--min/--max-prefill-workers and --min/--max-decode-workers (ValueError naming the flags)."""
        return RoleBounds(self.min_prefill_workers or 0, self.max_prefill_workers,
                          self.min_decode_workers or 0, self.max_decode_workers)

    def _check_scale(self) -> None:
        if self.scale == "fixed":
            given = ["--" + name.replace("_", "-") for name in SCALE_BOUNDS
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{' and '.join(given)} bound{'s' if len(given) == 1 else ''} the scale "
                                 "controller: give --scale auto too")
            return
        if self.ratio == "auto":
            raise ValueError("--scale auto chooses each worker's role too: drop --ratio auto")
        if self.max_workers is None:
            raise ValueError("--scale auto needs --max-workers: the most workers it may start")
        low = self.min_workers or 1
        if low > self.max_workers:
            raise ValueError(f"--min-workers {low} is above --max-workers {self.max_workers}")
        if self.profile is None:
            raise ValueError("--scale auto needs --profile (from `pdserve tune profile`): it predicts each "
                             "size's latency from a worker's measured step times")
        size = (self.prefill or 0) + (self.decode or 0) + (self.mixed or 0)
        if not low <= size <= self.max_workers:
            raise ValueError(f"the starting layout has {size} workers, outside --min-workers {low} .. "
                             f"--max-workers {self.max_workers}")
        roles = self.role_bounds()
        ScalePolicy(low, self.max_workers, roles)  # some size in range has a layout within the role bounds
        start = (self.prefill or 0, self.decode or 0, self.mixed or 0)
        if not roles.allows_counts(*start):
            raise ValueError(f"the starting layout (--prefill {start[0]} --decode {start[1]} --mixed "
                             f"{start[2]}) is outside {roles.describe()} (a mixed worker counts for both "
                             "roles)")


    @property
    def is_auto(self) -> bool:
        """A controller changes the pools: --ratio auto or --scale auto."""
        return self.ratio == "auto" or self.scale == "auto"
