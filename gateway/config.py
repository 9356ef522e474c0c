"""`pdserve serve` settings: from flags, environment variables (PDSERVE_<FIELD>) or a YAML file, validated
by pydantic, once, at load. Precedence: flags > environment > YAML > defaults.

One flat namespace of flags, built from one mixin per concern (gateway/settings/: the model, the engine, the
layout and its controllers, the HTTP edge, placement, admission and deadlines, the API's defaults), each with
its own fields and checks; the checks across concerns are here. Engine and transfer defaults are not repeated
here: a field left unset takes the engine's own default. What the settings become in each part's own
(DeploymentConfig, the router's and controller's policies, ...): gateway/serve_settings.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

import yaml
from pydantic import model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from gateway.settings.admission import AdmissionSettings
from gateway.settings.api import ApiSettings
from gateway.settings.engine import EngineSettings
from gateway.settings.http import LOOPBACK_HOSTS, HttpSettings
from gateway.settings.layout import SCALE_BOUNDS, LayoutSettings
from gateway.settings.model import ModelSettings
from gateway.settings.placement import PlacementSettings
from llm_engine.config import ModelSpec
from llm_engine.hardware import resolve_device, resolve_dtype
from llm_engine.model_files import is_local_path, read_model_spec
from llm_engine.rank_shares import check_tensor_parallel

__all__ = ["ENV_PREFIX", "LOOPBACK_HOSTS", "SCALE_BOUNDS", "ServeConfig"]
ENV_PREFIX = "PDSERVE_"  # a field's environment variable: PDSERVE_<FIELD NAME>


# The mixins' fields come in the reverse order of this list (pydantic's): model, engine, layout, HTTP,
# placement, admission, API, as `pdserve serve --help` lists them.
class ServeConfig(ApiSettings, AdmissionSettings, PlacementSettings, HttpSettings, LayoutSettings,
                  EngineSettings, ModelSettings, BaseSettings):
    """Every setting of `pdserve serve`, the one source of its flags, environment variables and YAML keys.

    A field is all it takes: pdserve/serve.py makes `--field-name` from it (its description is the flag's
    help, its default shown there), and pydantic-settings reads `PDSERVE_FIELD_NAME`. Precedence: flags >
    environment > YAML (`--config`) > these defaults. A default of None is described in words: it defers to
    the engine's or another part's own default, which is not repeated here.
    """

    model_config = SettingsConfigDict(extra="forbid", env_prefix=ENV_PREFIX, case_sensitive=False)

    @model_validator(mode="after")
    def _check_auto(self) -> Self:
        """What a controller that moves workers between roles needs: one TP degree, a backend that can."""
        auto = "--scale auto" if self.scale == "auto" else "--ratio auto"
        (_, prefill_tp), (_, decode_tp) = self.tp_degrees()
        if self.is_auto and prefill_tp != decode_tp:
            raise ValueError(f"--prefill-tp {prefill_tp} / --decode-tp {decode_tp}: {auto} moves "
                             "workers between roles, and a worker's ranks are fixed at its start: give both "
                             "roles one degree")
        if self.is_auto and self.backend == "torch":
            raise ValueError(f"{auto} moves workers between roles, which the torch backend's fixed "
                             "process group cannot: use --backend nixl")
        kv_dtypes = self.kv_cache_dtypes()
        if self.is_auto and kv_dtypes[0] != kv_dtypes[1]:
            raise ValueError(f"--prefill-kv-cache-dtype {kv_dtypes[0]} / --decode-kv-cache-dtype "
                             f"{kv_dtypes[1]}: {auto} moves workers between roles, and a worker's KV cache "
                             "is made at its start: give both roles one type")
        wire = self.kv_transfer_dtype
        if wire not in (None, "auto") and max(prefill_tp, decode_tp) > 1 and self.backend in ("nixl", "auto"):
            raise ValueError(f"--kv-transfer-dtype {wire} with tensor-parallel workers over nixl: each "
                             "rank's heads are read where they live, in its cache's own type (no 8-bit copy "
                             "per rank); give --backend torch, or leave it auto")
        is_mixed_int8 = kv_dtypes[0] != kv_dtypes[1] or wire not in (None, "auto")
        if "int8_per_token_head" in kv_dtypes and is_mixed_int8:
            raise ValueError("--kv-cache-dtype int8_per_token_head: its blocks carry their scales and "
                             "convert to no other type, so both roles keep it (--prefill-kv-cache-dtype / "
                             "--decode-kv-cache-dtype) and --kv-transfer-dtype stays auto")
        eight_bit = next((d for d in kv_dtypes if d.startswith("fp8")), None)
        if eight_bit and max(prefill_tp, decode_tp) > 1 and self.backend in (
                "torch", "local"):  # their rank 0 gathers every rank's heads over gloo, which has no float8
            raise ValueError(f"--kv-cache-dtype {eight_bit} with tensor-parallel workers needs "
                             f"--backend nixl (each rank's heads read where they live), not {self.backend}")
        return self

    @model_validator(mode="after")
    def _check_device_and_model(self) -> Self:
        """The device, its memory setting, the model's context and the dtype the device runs."""
        try:
            device = resolve_device(self.device or "auto")
        except ValueError as error:
            raise ValueError(f"--device: {error}") from None
        if self.gpu_memory_utilization is not None and not device.startswith("cuda"):
            raise ValueError("--gpu-memory-utilization sizes a GPU's memory (--device cuda); on a CPU size "
                             "the KV cache with --kv-cache-memory")
        if self.model is not None and is_local_path(self.model) and (
                self.max_model_len is not None or max(d for _, d in self.tp_degrees()) > 1):
            try:
                self.model_spec(self.model)  # a --max-model-len or TP degree the model refuses, here
            except FileNotFoundError as error:
                raise ValueError(f"--model: {error}") from None
        try:
            resolve_dtype(self.dtype or "auto", device)
        except ValueError as error:
            raise ValueError(f"--dtype {self.dtype}: {error}") from None
        return self

    @classmethod
    def env_values(cls) -> dict[str, object]:
        """The settings given as PDSERVE_<FIELD> environment variables (JSON decoded for dict fields)."""
        return dict(EnvSettingsSource(cls)())

    @classmethod
    def from_yaml(cls, path: str | Path | None, **overrides: object) -> ServeConfig:
        """Settings from a YAML file (or none), under the environment, under `overrides` (flags; None: not
        given)."""
        data: dict[str, object] = {}
        if path is not None:
            data = yaml.safe_load(Path(path).read_text()) or {}
            if not isinstance(data, dict):
                raise ValueError(f"{path}: expected a mapping of settings")
        data.update(cls.env_values())
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)  # type: ignore[arg-type]  # values from YAML, env and flags: validated here

    def model_spec(self, model_dir: str) -> ModelSpec:
        """The model's shape with the context this config allows (its own, or a shorter --max-model-len).

        Raises:
            ValueError: --max-model-len exceeds the model's context, or --tensor-parallel-size does not
                divide its heads (the message names the flag).
        """
        spec = read_model_spec(model_dir).with_max_model_len(self.max_model_len)
        for flag, degree in self.tp_degrees():
            check_tensor_parallel(spec, degree, flag)
        return spec
