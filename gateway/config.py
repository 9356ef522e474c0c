"""`pdserve serve` settings: from flags or a YAML file, validated by pydantic, once, at load.

Engine and transfer defaults are not repeated here: a field left unset takes the engine's own default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.deadlines import DeadlinePolicy
from gateway.pools import DeploymentConfig
from gateway.router import LocalPrefillPolicy
from kv_transfer import TransferConfig
from llm_engine import EngineConfig

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # HF model directory; None: the default model (prepared on first use)
    served_model_name: str | None = None  # the name clients send; default: the directory's name
    dtype: Literal["float32", "bfloat16"] | None = None
    device: str | None = None
    prefill: int = Field(default=1, ge=1)  # prefill workers
    decode: int = Field(default=1, ge=1)  # decode workers
    colocated: int = Field(default=0, ge=0)  # baseline: workers that prefill and decode (replaces P and D)
    backend: Literal["auto", "nixl", "torch"] = "auto"
    block_size: int | None = Field(default=None, ge=1)
    kv_cache_mib: int | None = Field(default=None, ge=1)  # KV budget per worker
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: str | None = None  # required as a Bearer token on /v1 routes and /metrics when set
    admin_key: str | None = None  # required on /admin routes; without it they answer on loopback only
    ray_address: str | None = None  # join this Ray cluster; None: start a local one
    max_waiting: int = Field(default=256, ge=0)  # requests that may wait for decode KV capacity
    max_waiting_tokens: int | None = Field(default=None, ge=0)  # tokens that may wait; default: the capacity
    queue_timeout_s: float = Field(default=60.0, gt=0)
    # Request deadlines (gateway/deadlines.py): slack per stage, and seconds per prompt / output token.
    deadline_slack_s: float | None = Field(default=None, gt=0)
    deadline_prefill_s_per_token: float | None = Field(default=None, ge=0)
    deadline_decode_s_per_token: float | None = Field(default=None, ge=0)
    # Conditional disaggregation (gateway/router.py LocalPrefillPolicy): a decode worker prefills a prompt
    # itself when at most this many of its tokens are uncached, or while every prefill worker has this
    # many prompt tokens queued.
    local_prefill_max_tokens: int | None = Field(default=None, ge=0)
    local_prefill_queue_tokens: int | None = Field(default=None, ge=0)
    default_max_tokens: int = Field(default=512, ge=1)  # chat requests that name no max_tokens

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, model: str | None) -> str | None:
        if model is not None and not Path(model).is_dir():
            raise ValueError(f"model directory {model!r} does not exist")
        return model

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

    def deadline_policy(self) -> DeadlinePolicy:
        chosen = {"slack_s": self.deadline_slack_s, "prefill_s_per_token": self.deadline_prefill_s_per_token,
                  "decode_s_per_token": self.deadline_decode_s_per_token}
        return DeadlinePolicy(**{k: v for k, v in chosen.items() if v is not None})

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    def deployment_config(self, model_dir: str) -> DeploymentConfig:
        engine_overrides: dict[str, object] = {
            "dtype": self.dtype, "device": self.device, "block_size": self.block_size,
            "kv_cache_bytes": None if self.kv_cache_mib is None else self.kv_cache_mib << 20,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        chosen = {k: v for k, v in engine_overrides.items() if v is not None}
        engine = EngineConfig(model_dir, **chosen)  # type: ignore[arg-type]
        gpus = 1.0 if engine.device.startswith("cuda") else 0.0
        if self.colocated:
            return DeploymentConfig(engine, num_prefill=0, num_decode=0, num_colocated=self.colocated,
                                    num_gpus_per_worker=gpus)
        return DeploymentConfig(engine, num_prefill=self.prefill, num_decode=self.decode,
                                backend=self.backend, transfer=TransferConfig(), num_gpus_per_worker=gpus)

