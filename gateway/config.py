"""`pdserve serve` settings: from flags or a YAML file, validated by pydantic, once, at load.

Engine and transfer defaults are not repeated here: a field left unset takes the engine's own default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.control.plane import PlannerSettings
from gateway.fleet.config import DeploymentConfig
from gateway.ratio.controller import ControllerPolicy
from gateway.requests.deadlines import DeadlinePolicy
from gateway.requests.router import LocalPrefillPolicy
from kv_transfer import TransferConfig
from llm_engine import EngineConfig
from llm_engine.hardware import resolve_dtype
from pool_worker import Role
from pool_worker.runtime.model_source import ModelSource

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # HF model directory; None: the default model (prepared on first use)
    served_model_name: str | None = None  # the name clients send; default: the directory's name
    # None: the engine's default, "auto" (bfloat16 where the hardware runs it natively, else float32).
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    device: str | None = None
    linear_kernel: Literal["auto", "torch", "onednn-packed"] | None = None  # None: the engine's ("auto")
    decode_attention: Literal["auto", "sdpa", "paged-kernel"] | None = None  # None: the engine's ("auto")
    # Torch threads per worker; None: this machine's cores split over the starting layout's workers (on a
    # cluster: the CPUs each worker asks Ray for).
    threads_per_worker: int | None = Field(default=None, ge=1)
    pin_cpus: bool = True  # each worker on its own cores (False: the OS places their threads)
    # Workers per role. None: 1 prefill + 1 decode when no role is named, else 0 of an unnamed role.
    prefill: int | None = Field(default=None, ge=0)
    decode: int | None = Field(default=None, ge=0)
    mixed: int | None = Field(default=None, ge=0)  # workers that prefill and decode their own requests
    colocated: int | None = Field(default=None, ge=0)  # the old name of `mixed`
    backend: Literal["auto", "nixl", "torch", "local"] = "auto"
    # The ratio controller (gateway/ratio/controller.py): "auto" moves workers between roles by load.
    ratio: Literal["fixed", "auto"] = "fixed"
    ttft_slo_s: float | None = Field(default=None, gt=0)  # the controller's targets
    # A worker's profile from `pdserve tune profile`: the controller's planner predicts layouts with it.
    profile: str | None = None
    itl_slo_s: float | None = Field(default=None, gt=0)
    block_size: int | None = Field(default=None, ge=1)
    kv_cache_mib: int | None = Field(default=None, ge=1)  # KV budget per worker
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    max_prefill_s_beside_decode: float | None = Field(default=None, ge=0)  # None: the engine's (0: off)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # HTTP frontends sharing one fleet (gateway/frontends.py): 1 runs the whole gateway in one process.
    api_server_count: int = Field(default=1, ge=1, le=64)
    api_key: str | None = None  # required as a Bearer token on /v1 routes and /metrics when set
    admin_key: str | None = None  # required on /admin routes; without it they answer on loopback only
    ray_address: str | None = None  # join this Ray cluster ("auto": the one on this node); None: a local one
    # Placement (gateway/fleet/placement.py): Ray custom resources each role's workers ask for, so that only
    # nodes
    # started with them (ray start --resources '{"pdserve_decode": 1}') take that role.
    prefill_resources: dict[str, float] | None = None
    decode_resources: dict[str, float] | None = None
    mixed_resources: dict[str, float] | None = None
    gpus_per_worker: float | None = Field(default=None, ge=0)  # default: 1 with a CUDA device, else 0
    cpus_per_worker: float | None = Field(default=None, ge=0)
    # Environment of every worker process, e.g. {"UCX_NET_DEVICES": "mlx5_0:1"} (deploy/README.md).
    worker_env: dict[str, str] | None = None
    placement_timeout_s: float | None = Field(default=None, gt=0)  # start-up's wait for Ray to place workers
    autoscale_wait_s: float | None = Field(
        default=None, gt=0,
        description="The cluster autoscales (KubeRay in-tree, `ray up`): PUT /admin/pools accepts a layout "
                    "larger than the resources free now, its new workers wait pending (their resource "
                    "demands reach Ray's autoscaler) up to this many seconds each, then are given up as "
                    "unplaceable. None: such a layout is refused (400).")
    max_waiting: int = Field(default=256, ge=0)  # requests that may wait for decode KV capacity
    max_waiting_tokens: int | None = Field(default=None, ge=0)  # tokens that may wait; default: the capacity
    queue_timeout_s: float = Field(default=60.0, gt=0)
    # Request deadlines (gateway/requests/deadlines.py): slack per stage, and seconds per prompt / output
    # token.
    deadline_slack_s: float | None = Field(default=None, gt=0)
    deadline_prefill_s_per_token: float | None = Field(default=None, ge=0)
    deadline_decode_s_per_token: float | None = Field(default=None, ge=0)
    # Conditional disaggregation (gateway/requests/router.py LocalPrefillPolicy): a decode worker prefills a
    # prompt
    # itself when at most this many of its tokens are uncached, or while every prefill worker has this
    # many prompt tokens queued.
    local_prefill_max_tokens: int | None = Field(default=None, ge=0)
    local_prefill_queue_tokens: int | None = Field(default=None, ge=0)
    default_max_tokens: int = Field(default=512, ge=1)  # chat requests that name no max_tokens
    # How the model writes tool calls (gateway/api/tool_parsers.py); auto: detected from the chat template.
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = "auto"

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, profile: str | None) -> str | None:
        if profile is not None and not Path(profile).is_file():
            raise ValueError(f"profile {profile!r} does not exist (make one with `pdserve tune profile`)")
        return profile

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, model: str | None) -> str | None:
        if model is not None and not Path(model).is_dir():
            raise ValueError(f"model directory {model!r} does not exist")
        return model

    @model_validator(mode="after")
    def _layout_can_serve(self) -> ServeConfig:
        if self.colocated is not None:
            if self.mixed is not None and self.mixed != self.colocated:
                raise ValueError("--colocated is the old name of --mixed: give one of them")
            self.mixed, self.colocated = self.colocated, None
        if self.prefill is None and self.decode is None and self.mixed is None:
            self.prefill, self.decode = 1, 1
        if self.ratio == "auto" and self.backend == "torch":
            raise ValueError("--ratio auto moves workers between roles, which the torch backend's fixed "
                             "process group cannot: use --backend nixl")
        prefill, decode, mixed = self.prefill or 0, self.decode or 0, self.mixed or 0
        try:
            resolve_dtype(self.dtype or "auto", self.device or "cpu")
        except ValueError as error:
            raise ValueError(f"--dtype {self.dtype}: {error}") from None
        if prefill + mixed < 1 or decode + mixed < 1:
            raise ValueError(f"--prefill/--decode/--mixed: {prefill} prefill + {decode} decode + {mixed} "
                             "mixed cannot serve: "
                             "it needs a worker that can prefill (prefill or mixed) and one that can decode "
                             "(decode or mixed)")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: object) -> ServeConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of settings")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(data)

    def local_prefill_policy(self) -> LocalPrefillPolicy:
        chosen = {"max_uncached_tokens": self.local_prefill_max_tokens,
                  "min_prefill_queue_tokens": self.local_prefill_queue_tokens}
        return LocalPrefillPolicy(**{k: v for k, v in chosen.items() if v is not None})

    def controller_policy(self) -> ControllerPolicy:
        default = ControllerPolicy()
        return ControllerPolicy(ttft_slo_s=self.ttft_slo_s or default.ttft_slo_s,
                                itl_slo_s=self.itl_slo_s or default.itl_slo_s)

    def planner_settings(self) -> PlannerSettings | None:
        if self.profile is None:
            return None
        local_prefill = self.local_prefill_policy()
        return PlannerSettings(self.profile, self.max_waiting, self.queue_timeout_s,
                               local_prefill.isolate_prompts_from_tokens,
                               local_prefill.move_streams_from_tokens)

    def deadline_policy(self) -> DeadlinePolicy:
        chosen = {"slack_s": self.deadline_slack_s, "prefill_s_per_token": self.deadline_prefill_s_per_token,
                  "decode_s_per_token": self.deadline_decode_s_per_token}
        return DeadlinePolicy(**{k: v for k, v in chosen.items() if v is not None})

    def default_threads_per_worker(self) -> int:
        """--threads-per-worker, else this machine's cores split over the layout's workers (a cluster's
        nodes are not this machine: there, the CPUs each worker asks Ray for)."""
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        if self.ray_address is not None:
            return max(1, int(self.cpus_per_worker or 1))
        num_workers = (self.prefill or 0) + (self.decode or 0) + (self.mixed or 0)
        return max(1, len(os.sched_getaffinity(0)) // max(1, num_workers))

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    def deployment_config(self, model_dir: str) -> DeploymentConfig:
        engine_overrides: dict[str, object] = {
            "dtype": self.dtype, "device": self.device, "block_size": self.block_size,
            "kv_cache_bytes": None if self.kv_cache_mib is None else self.kv_cache_mib << 20,
            "max_num_batched_tokens": self.max_num_batched_tokens, "linear_kernel": self.linear_kernel,
            "max_prefill_s_beside_decode": self.max_prefill_s_beside_decode,
            "decode_attention": self.decode_attention,
        }
        chosen = {k: v for k, v in engine_overrides.items() if v is not None}
        engine = EngineConfig(model_dir, **chosen)  # type: ignore[arg-type]
        chosen_resources = {Role.PREFILL: self.prefill_resources, Role.DECODE: self.decode_resources,
                            Role.MIXED: self.mixed_resources}
        placement: dict[str, object] = {
            "num_gpus_per_worker": self.gpus_per_worker, "num_cpus_per_worker": self.cpus_per_worker,
            "placement_timeout_s": self.placement_timeout_s, "autoscale_wait_s": self.autoscale_wait_s,
        }
        if self.gpus_per_worker is None and engine.device.startswith("cuda"):
            placement["num_gpus_per_worker"] = 1.0
        return DeploymentConfig(engine, num_prefill=self.prefill or 0, num_decode=self.decode or 0,
                                num_mixed=self.mixed or 0, backend=self.backend, transfer=TransferConfig(),
                                role_resources={r: x for r, x in chosen_resources.items() if x},
                                worker_env=dict(self.worker_env or {}),
                                # Each worker finds the model on its own node
                                # (pool_worker/runtime/model_source.py).
                                model_source=ModelSource(self.model),
                                num_threads=self.default_threads_per_worker(), pin_cpus=self.pin_cpus,
                                **{k: v for k, v in placement.items() if v is not None})  # type: ignore[arg-type]

