"""The body of PUT /admin/pools (gateway/ratio/resize.py applies it): worker counts by role, each role's
tensor-parallel degree, how long a drain's streams may run on and an added worker may wait for a node; or
the controller turned on or off."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.drain import DRAIN_GRACE_S
from worker_runtime.roles import Role


class PoolLayout(BaseModel):
    """The body of PUT /admin/pools: how many workers of each role the deployment should have (a count not
    given is 0), or {"auto": true|false} to turn the ratio controller on or off. Setting a layout by hand
    turns the controller off."""

    model_config = ConfigDict(extra="forbid", strict=True)

    prefill: int = Field(default=0, ge=0, le=1024)
    decode: int = Field(default=0, ge=0, le=1024)
    mixed: int = Field(default=0, ge=0, le=1024)
    # How long a leaving worker's decode streams may run on before they move to other workers (they lose no
    # token either way: the new worker continues from the tokens the client has, pulling the KV the leaving
    # worker offers).
    drain_grace_s: float = Field(default=DRAIN_GRACE_S, ge=0, le=3600)
    # How long a worker this change adds may wait for a node before it is given up as unplaceable (None: the
    # server's --autoscale-wait-s where the cluster autoscales, else its --placement-timeout-s). An operator
    # who knows a node is on its way, or knows none is, says so for this change.
    placement_wait_s: float | None = Field(default=None, gt=0, le=24 * 3600)
    # The tensor-parallel degree of the workers of a role from now on (mixed workers take decode's); None: as
    # it is. The role's workers at another degree are replaced, the new ones added before the old drain.
    prefill_tp: int | None = Field(default=None, ge=1, le=64)
    decode_tp: int | None = Field(default=None, ge=1, le=64)
    auto: bool | None = None

    @model_validator(mode="after")
    def _layout_or_auto(self) -> PoolLayout:
        counts = self.model_fields_set & {"prefill", "decode", "mixed"}
        if self.auto is not None and (counts or self.model_fields_set & {"placement_wait_s", "prefill_tp",
                                                                          "decode_tp"}):
            raise ValueError("give either worker counts (with placement_wait_s, prefill_tp, decode_tp) or "
                             "auto, not both")
        if self.auto is None and not counts:
            raise ValueError("give worker counts (prefill, decode, mixed) or auto")
        return self

    def by_role(self) -> dict[Role, int]:
        return {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.MIXED: self.mixed}

    def role_tp(self, config: DeploymentConfig) -> dict[Role, int] | None:
        """The degrees of prefill and of decode (and mixed) workers after this change, or None where the
        body sets none."""
        if self.prefill_tp is None and self.decode_tp is None:
            return None
        return {Role.PREFILL: self.prefill_tp or config.tp_of(Role.PREFILL),
                Role.DECODE: self.decode_tp or config.tp_of(Role.DECODE)}
