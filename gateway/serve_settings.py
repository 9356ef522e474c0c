"""What `pdserve serve`'s settings (ServeConfig, gateway/config.py) become in each part's own settings: the
fleet's DeploymentConfig, the router's LocalPrefillPolicy, the ratio controller's ControllerPolicy, the
planner's PlannerSettings and the request deadlines' DeadlinePolicy. A setting left unset defers to that
part's own default, which is not repeated here.

The HTTP settings (checked in gateway/http_settings.py) become uvicorn's options (--uvicorn-log-level,
--disable-uvicorn-access-log, --ssl-*), the app's root_path (--root-path), and CORS (--allowed-origins with
--allowed-methods, --allowed-headers, --allow-credentials) as Starlette's CORSMiddleware. One process
(pdserve/serve.py) and every --api-server-count frontend (gateway/frontends.py) take the same options from
uvicorn_options(); create_app() sets the root path and adds the CORS middleware.

The root path is the app's, as vLLM sets it, not uvicorn's: uvicorn's would prefix every request's path, so
that only the proxy's stripped paths answered; the app's lets the routes answer with and without the prefix.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from gateway.config import ServeConfig
from gateway.control.plane import PlannerSettings
from gateway.fleet.config import DeploymentConfig
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.sizing import ScalePolicy
from gateway.requests.deadlines import DeadlinePolicy
from gateway.requests.router import LocalPrefillPolicy
from kv_transfer import TransferConfig
from llm_engine.config import EIGHT_BIT_KV_DTYPES, EngineConfig
from llm_engine.kv_sizing import parse_memory
from worker_runtime.model_source import ModelSource
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from fastapi import FastAPI


def kv_memory_settings(config: ServeConfig) -> dict[str, int | float]:
    """The engine's KV memory fields for --kv-cache-memory (or the old --kv-cache-mib); empty: neither."""
    if config.kv_cache_memory is not None:
        amount = parse_memory(config.kv_cache_memory)
        if amount.fraction is not None:
            return {"kv_cache_fraction": amount.fraction}
        return {"kv_cache_bytes": amount.num_bytes or 0}
    return {} if config.kv_cache_mib is None else {"kv_cache_bytes": config.kv_cache_mib << 20}


def local_prefill_policy(config: ServeConfig) -> LocalPrefillPolicy:
    chosen = {"max_uncached_tokens": config.local_prefill_max_tokens,
              "min_prefill_queue_tokens": config.local_prefill_queue_tokens}
    return LocalPrefillPolicy(**{k: v for k, v in chosen.items() if v is not None},
                              prefix_aware=config.prefill_routing == "prefix")


def controller_policy(config: ServeConfig) -> ControllerPolicy:
    return ControllerPolicy(ttft_slo_s=config.ttft_slo_s, itl_slo_s=config.itl_slo_s)


def planner_settings(config: ServeConfig) -> PlannerSettings | None:
    if config.profile is None:
        return None
    local_prefill = local_prefill_policy(config)
    scale = None
    if config.scale == "auto":
        assert config.max_workers is not None  # checked with the settings
        scale = ScalePolicy(config.min_workers or 1, config.max_workers, config.role_bounds(),
                            window_s=config.scale_window_s,
                            in_calm_s=config.scale_in_calm_s, interval_s=min(10.0, config.scale_window_s / 6))
    return PlannerSettings(config.profile, config.max_waiting, config.queue_timeout_s,
                           local_prefill.isolate_prompts_from_tokens, local_prefill.move_streams_from_tokens,
                           scale)


def deadline_policy(config: ServeConfig) -> DeadlinePolicy:
    chosen = {"slack_s": config.deadline_slack_s, "prefill_s_per_token": config.deadline_prefill_s_per_token,
              "decode_s_per_token": config.deadline_decode_s_per_token}
    return DeadlinePolicy(**{k: v for k, v in chosen.items() if v is not None})


def threads_per_worker(config: ServeConfig) -> int:
    """--threads-per-worker, else this machine's cores split over the layout's workers (with --scale auto,
    over --max-workers: the fleet may grow to that many here); a cluster's nodes are not this machine:
    there, the CPUs each worker asks Ray for."""
    if config.threads_per_worker is not None:
        return config.threads_per_worker
    if config.ray_address is not None:
        return max(1, int(config.cpus_per_worker or 1))
    (_, prefill_tp), (_, decode_tp) = config.tp_degrees()  # each rank a process of its own
    num_ranks = (config.prefill or 0) * prefill_tp + ((config.decode or 0) + (config.mixed or 0)) * decode_tp
    if config.scale == "auto" and config.max_workers is not None:  # the most that may share this machine
        num_ranks = max(num_ranks, config.max_workers * max(prefill_tp, decode_tp))
    return max(1, len(os.sched_getaffinity(0)) // max(1, num_ranks))


def deployment_config(config: ServeConfig, model_dir: str) -> DeploymentConfig:
    """The fleet's settings: the layout, each worker's engine, placement and transfer."""
    engine_overrides: dict[str, object] = {
        "dtype": config.dtype, "device": config.device, "block_size": config.block_size,
        "kv_cache_dtype": config.kv_cache_dtype,
        **kv_memory_settings(config), "gpu_memory_utilization": config.gpu_memory_utilization,
        "max_model_len": config.max_model_len, "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens, "linear_kernel": config.linear_kernel,
        "max_prefill_s_beside_decode": config.max_prefill_s_beside_decode,
        "decode_attention": config.decode_attention, "compile": config.compile,
        # A worker serves from its load (one added under a burst, or a failed one's replacement), eager
        # until its body is compiled beside serving (--compile auto; "on" compiles before it serves).
        "compile_in_background": True,
        "tensor_parallel_size": config.tensor_parallel_size,
    }
    chosen = {k: v for k, v in engine_overrides.items() if v is not None}
    engine = EngineConfig(model_dir, **chosen)  # type: ignore[arg-type]
    wire_dtype = EIGHT_BIT_KV_DTYPES.get(config.kv_transfer_dtype or "auto", "")  # "": each cache's own
    chosen_resources = {Role.PREFILL: config.prefill_resources, Role.DECODE: config.decode_resources,
                        Role.MIXED: config.mixed_resources}
    placement: dict[str, object] = {
        "num_gpus_per_worker": config.gpus_per_worker, "num_cpus_per_worker": config.cpus_per_worker,
        "placement_timeout_s": config.placement_timeout_s, "autoscale_wait_s": config.autoscale_wait_s,
        "step_watchdog_s": config.step_watchdog_s,
    }
    if config.gpus_per_worker is None and engine.device.startswith("cuda"):
        placement["num_gpus_per_worker"] = 1.0
    return DeploymentConfig(engine, num_prefill=config.prefill or 0, num_decode=config.decode or 0,
                            num_mixed=config.mixed or 0, backend=config.backend,
                            transfer=TransferConfig(wire_dtype=wire_dtype),
                            role_resources={r: x for r, x in chosen_resources.items() if x},
                            worker_env=dict(config.worker_env or {}),
                            role_tp={role: tp for role, tp in ((Role.PREFILL, config.prefill_tp),
                                                               (Role.DECODE, config.decode_tp)) if tp},
                            role_kv_cache_dtype={role: kv_dtype for role, kv_dtype in (
                                (Role.PREFILL, config.prefill_kv_cache_dtype),
                                (Role.DECODE, config.decode_kv_cache_dtype)) if kv_dtype},
                            # Each worker finds the model on its own node
                            # (pool_worker/runtime/model_source.py).
                            model_source=ModelSource.named(config.model, config.revision, model_dir),
                            num_threads=threads_per_worker(config), pin_cpus=config.pin_cpus,
                            **{k: v for k, v in placement.items() if v is not None})  # type: ignore[arg-type]


def uvicorn_options(config: ServeConfig) -> dict[str, Any]:
    """The options every uvicorn server of this gateway runs with, beside the app, host and port."""
    return {"log_level": config.uvicorn_log_level, "access_log": not config.disable_uvicorn_access_log,
            "ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile,
            "ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": config.ssl_cert_reqs,
            "timeout_graceful_shutdown": config.shutdown_grace_s}


def add_cors(app: FastAPI, config: ServeConfig) -> None:
    """CORS headers for the origins --allowed-origins names (none given: no CORS headers, so a browser page
    from another origin cannot read the answers)."""
    from starlette.middleware.cors import CORSMiddleware

    if config.allowed_origins is None:
        return
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                       allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
                       allow_credentials=config.allow_credentials)


def base_url(config: ServeConfig) -> str:
    """Where this server listens, as start-up says it: http or https, host and port (a proxy in front adds
    --root-path; the server answers with and without it)."""
    scheme = "https" if config.ssl_certfile else "http"
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{scheme}://{host}:{config.port}"
