"""Where the workers run: the Ray cluster, the fleet's name, each role's resources, the waits for a node."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, Field, model_validator


class PlacementSettings(BaseModel):
    fleet_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="keep the workers in a detached Ray actor of this name that outlives the gateway "
                    "process (needs --address: a cluster that outlives it too): a gateway started again with "
                    "the same settings, e.g. by a supervisor, rejoins it and finds its workers as they were; "
                    "with other settings it replaces them (default: none, the workers stop with the gateway)")
    ray_address: str | None = Field(
        None,
        description="join this Ray cluster ('auto': the cluster this node belongs to, e.g. on a Ray head) "
                    "(default: start a local one)")
    # Placement (gateway/fleet/placement.py): only nodes started with these resources
    # (ray start --resources '{"pdserve_decode": 1}') take that role.
    prefill_resources: dict[str, float] | None = Field(
        None,
        description="Ray custom resources each prefill worker asks for, as JSON, e.g. '{\"pdserve_prefill\": "
                    "1}': only nodes offering them run prefill (default: none)")
    decode_resources: dict[str, float] | None = Field(
        None,
        description="the same for decode workers, e.g. '{\"pdserve_decode\": 1}' (default: none)")
    mixed_resources: dict[str, float] | None = Field(
        None,
        description="the same for mixed workers (default: none)")
    gpus_per_worker: float | None = Field(
        None, ge=0,
        description="GPUs each worker asks Ray for; fractions share a GPU (default: 1 with --device cuda, "
                    "else 0)")
    cpus_per_worker: float | None = Field(
        None, ge=0,
        description="CPUs each worker asks Ray for (default: gateway/fleet/config.py's, 1)")
    worker_env: dict[str, str] | None = Field(
        None,
        description="environment of every worker process as JSON, e.g. "
                    "'{\"UCX_NET_DEVICES\": \"mlx5_0:1\"}' (see deploy/README.md) (default: none)")
    placement_timeout_s: float | None = Field(
        None, gt=0,
        description="how long start-up waits for Ray to place every worker before it serves with those "
                    "placed, or fails naming what no node offers (default: gateway/fleet/config.py's)")
    autoscale_wait_s: float | None = Field(
        None, gt=0,
        description="the cluster autoscales (KubeRay in-tree, `ray up`): PUT /admin/pools accepts a layout "
                    "larger than the resources free now; its new workers wait pending (their resource "
                    "demands reach Ray's autoscaler) up to this many seconds each, then are given up as "
                    "unplaceable "
                    "(default: off, such a layout is refused with a 400)")

    @model_validator(mode="after")
    def _named_fleet_on_a_cluster(self) -> Self:
        if self.fleet_name is not None and self.ray_address is None:
            raise ValueError("--fleet-name keeps the workers beyond the gateway process, in a Ray cluster "
                             "that outlives it: give --address too (a local Ray ends with the gateway)")
        return self
