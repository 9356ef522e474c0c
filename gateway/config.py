# Over 300 lines: one settings model of ~50 fields, each with its flag's help (translators: serve_settings.py)
"""`pdserve serve` settings: from flags, environment variables (PDSERVE_<FIELD>) or a YAML file, validated
by pydantic, once, at load. Precedence: flags > environment > YAML > defaults.

Engine and transfer defaults are not repeated here: a field left unset takes the engine's own default. What
the settings become in each part's own (DeploymentConfig, the router's and controller's policies, ...):
gateway/serve_settings.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, NoDecode, SettingsConfigDict

from gateway.api.chat_template import load_chat_template
from gateway.api.sampling_defaults import check_generation_config
from gateway.fleet.config import CANNOT_SERVE, can_serve
from gateway.http_settings import check_root_path, check_tls, json_list
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.role_bounds import RoleBounds
from gateway.ratio.sizing import ScalePolicy
from gateway.telemetry.tracing import check_endpoint
from llm_engine import ModelSpec
from llm_engine.hardware import resolve_device, resolve_dtype
from llm_engine.kv_sizing import parse_memory
from llm_engine.model_files import check_model_name, is_local_path
from llm_engine.model_loader import read_model_spec
from llm_engine.tensor_parallel import check_tensor_parallel
from worker_runtime.roles import Role

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
SCALE_BOUNDS = ("min_workers", "max_workers", "min_prefill_workers", "max_prefill_workers",
                "min_decode_workers", "max_decode_workers")  # flags that only --scale auto takes
ENV_PREFIX = "PDSERVE_"  # a field's environment variable: PDSERVE_<FIELD NAME>


class ServeConfig(BaseSettings):
    """Every setting of `pdserve serve`, the one source of its flags, environment variables and YAML keys.

    A field is all it takes: pdserve/serve.py makes `--field-name` from it (its description is the flag's
    help, its default shown there), and pydantic-settings reads `PDSERVE_FIELD_NAME`. Precedence: flags >
    environment > YAML (`--config`) > these defaults. A default of None is described in words: it defers to
    the engine's or another part's own default, which is not repeated here.
    """

    model_config = SettingsConfigDict(extra="forbid", env_prefix=ENV_PREFIX, case_sensitive=False)

    model: str | None = Field(
        None,
        description="a Hugging Face model id (org/name, resolved through the Hugging Face cache: HF_HOME, "
                    "HF_HUB_OFFLINE, HF_TOKEN) or a local model directory; also the positional MODEL "
                    "(default: SmolLM2-135M-Instruct, prepared on first use)")
    revision: str | None = Field(
        None, description="branch, tag or commit of a Hugging Face model id (default: its default branch)")
    served_model_name: str | None = Field(
        None,
        description="model name clients send (default: the id as given, or the model directory's name)")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None,
        description="auto, float32, bfloat16, or float16 (CUDA only) (default: the engine's, auto: bfloat16 "
                    "where the hardware runs it natively: AVX512_BF16 or AMX on a CPU, any CUDA GPU; else "
                    "float32)")
    device: str | None = Field(
        None, description="auto, cpu, cuda or cuda:N (default: the engine's, auto: cuda where this process "
                          "sees a GPU, else cpu; on a cluster whose head has no GPU, give cuda)")
    compile: Literal["auto", "on", "off"] | None = Field(
        None,
        description="the model body as one compiled graph (torch.compile, inductor): auto (compile where it "
                    "wins: CUDA, and CPUs that compute bfloat16 natively, beside serving: a worker serves "
                    "eager from its load and swaps the compiled body in when it is done; eager elsewhere, "
                    "and eager with the reason logged if compiling fails), on (compiled before the worker "
                    "serves; a failure stops it) or off (default: the engine's, auto)")
    linear_kernel: Literal["auto", "torch", "onednn-packed", "zentorch"] | None = Field(
        None,
        description="GEMM kernel of the linear layers: auto, torch (F.linear), onednn-packed (CPU: weights "
                    "prepacked once) or zentorch (AMD CPUs, the extra pdserve[zen]) (default: the engine's, "
                    "auto: probed at load, per weight shape and band of row counts)")
    decode_attention: Literal["auto", "sdpa", "paged-kernel"] | None = Field(
        None,
        description="sdpa (gather + torch SDPA padded to the batch's longest context, bit-identical to "
                    "transformers) or paged-kernel (pdserve's C++ kernel, CPU only: each sequence reads only "
                    "its own context) (default: the engine's, auto: paged-kernel on a CPU where it builds)")
    threads_per_worker: int | None = Field(
        None, ge=1,
        description="torch threads per worker; each worker is pinned to its own cores (default: this "
                    "machine's cores split over the starting layout's workers; on a cluster, "
                    "--cpus-per-worker)")
    pin_cpus: bool = Field(
        True,
        description="pin each worker to its own cores (--no-pin-cpus: the OS places the workers' threads)")
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
    block_size: int | None = Field(None, ge=1, description="tokens per KV block (default: the engine's)")
    # Sizing (llm_engine/kv_sizing.py; None: the engine's default).
    max_model_len: int | None = Field(
        None, ge=1,
        description="prompt + output tokens one request may hold (default: the model's own context; more is "
                    "refused)")
    max_num_seqs: int | None = Field(
        None, ge=1, description="requests one forward may carry (default: the engine's, 64)")
    kv_cache_memory: str | int | float | None = Field(
        None,
        description="KV cache per worker: bytes (2GiB, 512MiB) or a fraction of the free memory (0.2: of "
                    "free RAM on a CPU, of free GPU memory on CUDA) as each worker starts (default: 512MiB "
                    "on a CPU; on CUDA --gpu-memory-utilization decides); wins over --kv-cache-mib")
    kv_cache_mib: int | None = Field(
        None, ge=1,
        description="the old form of --kv-cache-memory NMiB, which wins when both are given (default: unset)")
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1,
        description="CUDA: share of the GPU's total memory each worker may use; the KV cache gets what the "
                    "weights and activations leave (default: the engine's, 0.9; --kv-cache-memory overrides "
                    "it)")
    max_num_batched_tokens: int | None = Field(
        None, ge=1,
        description="tokens per forward, the prefill chunk budget (default: the engine's)")
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="ranks (processes, each a Ray actor on the worker's node) each worker's model is split "
                    "over, Megatron-style: each holds 1/N of every layer's heads, MLP and KV cache; N must "
                    "divide the model's attention and KV heads")
    prefill_tp: int | None = Field(
        None, ge=1,
        description="the prefill workers' tensor-parallel degree (default: --tensor-parallel-size)")
    decode_tp: int | None = Field(
        None, ge=1,
        description="the decode and mixed workers' tensor-parallel degree (default: --tensor-parallel-size); "
                    "KV moves between workers of any two degrees")
    max_prefill_s_beside_decode: float | None = Field(
        None, ge=0,
        description="seconds of prompt work a worker adds to a step while it also decodes (mixed workers): "
                    "prompts are sliced to fit, from measured step times, so streams there are not stalled by"
                    " a whole prompt chunk (default: the engine's, 0: off; it costs prefill throughput on a "
                    "CPU, see README)")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port")
    # The HTTP server, under vLLM's names (checked in gateway/http_settings.py; uvicorn's options and CORS:
    # gateway/serve_settings.py).
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = Field(
        "info", description="uvicorn's log level: its access log is at info")
    disable_uvicorn_access_log: bool = Field(
        False, description="no access log line per request (--no-disable-uvicorn-access-log: one each)")
    ssl_keyfile: str | None = Field(
        None,
        description="serve HTTPS with this private key (PEM), with --ssl-certfile (default: none, HTTP)")
    ssl_certfile: str | None = Field(
        None, description="serve HTTPS with this certificate (PEM, its chain after it), with --ssl-keyfile "
                          "(default: none, HTTP)")
    ssl_ca_certs: str | None = Field(
        None, description="with HTTPS: the CA certificates (PEM) client certificates are checked against "
                          "(default: none)")
    ssl_cert_reqs: int = Field(
        0, ge=0, le=2,
        description="with HTTPS: client certificates, as Python's ssl.CERT_*: 0 not asked for, 1 checked if "
                    "sent, 2 required (needs --ssl-ca-certs)")
    root_path: str = Field(
        "",
        description="the path prefix a reverse proxy serves this server under, e.g. /llm (ASGI root_path: "
                    "the OpenAPI description's servers and docs links carry it; the routes answer with and "
                    "without it) (default: none)")
    # NoDecode: the variable is read by _list_as_vllm_gives_it (a JSON list or words), not as JSON only.
    allowed_origins: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="answer CORS for these browser origins, a JSON list as vLLM's "
                    "'[\"https://app.example\"]' or several values; [\"*\"]: any (default: none, no CORS "
                    "headers; vLLM's is any)")
    allowed_methods: Annotated[list[str], NoDecode] = Field(
        ["*"], description="with --allowed-origins: the methods CORS allows, a JSON list or several values")
    allowed_headers: Annotated[list[str], NoDecode] = Field(
        ["*"], description="with --allowed-origins: the request headers CORS allows, a JSON list or several "
                           "values")
    allow_credentials: bool = Field(
        False, description="with --allowed-origins: CORS allows credentials (cookies, Authorization)")
    disable_fastapi_docs: bool = Field(
        False, description="serve no /openapi.json, /docs or /redoc (--no-disable-fastapi-docs: serve them)")
    api_server_count: int = Field(
        1, ge=1, le=64,
        description="HTTP frontends on that port, sharing one fleet of workers (in a named Ray actor): 1 "
                    "serves in the gateway's own process; more are processes of their own, one that dies "
                    "is restarted")
    fleet_name: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
        description="keep the workers in a detached Ray actor of this name that outlives the gateway "
                    "process (needs --address: a cluster that outlives it too): a gateway started again with "
                    "the same settings, e.g. by a supervisor, rejoins it and finds its workers as they were; "
                    "with other settings it replaces them (default: none, the workers stop with the gateway)")
    api_key: str | None = Field(
        None,
        description="require this Bearer key on /v1 routes, and on /metrics with --metrics-require-key "
                    "(default: none, open)")
    admin_key: str | None = Field(
        None,
        description="require this Bearer key on /admin routes (default: none, /admin answers on loopback "
                    "only)")
    metrics_require_key: bool = Field(
        False, description="require the API key on /metrics too (--no-metrics-require-key: /metrics is open, "
                           "as in vLLM, whose scrapers send no key)")
    otlp_traces_endpoint: str | None = Field(
        None, description="send an OpenTelemetry trace of each request, a span per stage, to this OTLP "
                          "collector URL, e.g. http://localhost:4318/v1/traces (needs pip install "
                          "'pdserve[otel]'; default: none, no traces)")
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
    max_waiting: int = Field(
        256, ge=0,
        description="requests that may wait for decode KV capacity before 429")
    max_waiting_tokens: int | None = Field(
        None, ge=0,
        description="tokens (prompt + max_tokens) that may wait before 429 (default: the KV capacity)")
    queue_timeout_s: float = Field(
        60.0, gt=0,
        description="seconds a request may wait for capacity before 429")
    shutdown_grace_s: int = Field(
        30, ge=1,
        description="on SIGTERM/SIGINT, requests in flight may finish this long, s; those still open at "
                    "0.8 of it end with a clear 503 (code shutting_down)")
    step_watchdog_s: float = Field(
        120.0, ge=0,
        description="a worker whose step has run this long, and 10x its longest finished step, is taken "
                    "for hung: replaced, its requests moved (0: never)")
    deadline_slack_s: float | None = Field(
        None, gt=0,
        description="request deadlines: slack per stage, s (default: gateway/requests/deadlines.py's)")
    deadline_prefill_s_per_token: float | None = Field(
        None, ge=0,
        description="request deadlines: seconds per prompt token (default: deadlines.py's)")
    deadline_decode_s_per_token: float | None = Field(
        None, ge=0,
        description="request deadlines: seconds per output token (default: deadlines.py's)")
    # Conditional disaggregation (gateway/requests/router.py LocalPrefillPolicy).
    local_prefill_max_tokens: int | None = Field(
        None, ge=0,
        description="decode workers prefill prompts with at most this many uncached tokens themselves "
                    "(default: off)")
    local_prefill_queue_tokens: int | None = Field(
        None, ge=0,
        description="... or any prompt while every prefill worker has this many tokens queued (default: off)")
    prefill_routing: Literal["prefix", "load"] = Field(
        "prefix",
        description="how a prompt's prefill worker is picked: prefix (the fewest prompt tokens queued less "
                    "those its prefix cache probably holds) or load (the fewest queued: least loaded)")
    default_max_tokens: int | None = Field(
        None, ge=1,
        description="max_tokens of chat requests that give none (default: as vLLM, the model's "
                    "generation_config.json max_new_tokens, else all the context the prompt leaves)")
    tool_call_parser: Literal["auto", "hermes", "llama3_json"] = Field(
        "auto",
        description="how the model writes tool calls: hermes (<tool_call> JSON: Qwen2, Hermes, ChatML), "
                    "llama3_json, or auto (detected from the chat template)")
    # Reasoning models and the model's own files (gateway/api/reasoning.py, chat_template.py,
    # sampling_defaults.py).
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = Field(
        None,
        description="split a thinking model's <think>...</think> off the answer into message.reasoning "
                    "(and reasoning_content), streamed too: qwen3 (follows chat_template_kwargs "
                    "enable_thinking) or deepseek_r1 (the output starts inside the reasoning) "
                    "(default: none, the thinking stays in content)")
    chat_template: str | None = Field(
        None,
        description="a Jinja chat template replacing the tokenizer's: a file, or the template's text "
                    "(default: the model's own)")
    generation_config: str = Field(
        "auto",
        description="sampling defaults for the fields a request leaves unset: auto (the model's "
                    "generation_config.json, as vLLM), vllm (ignore it: temperature 1, top_p 1) or a "
                    "directory holding a generation_config.json (its max_new_tokens then caps every "
                    "request)")

    @field_validator("profile")
    @classmethod
    def _profile_exists(cls, profile: str | None) -> str | None:
        if profile is not None and not Path(profile).is_file():
            raise ValueError(f"profile {profile!r} does not exist (make one with `pdserve tune profile`)")
        return profile

    @field_validator("chat_template")
    @classmethod
    def _chat_template_loads(cls, template: str | None) -> str | None:
        if template is not None:
            load_chat_template(template)
        return template

    @field_validator("generation_config")
    @classmethod
    def _generation_config_exists(cls, source: str) -> str:
        return check_generation_config(source)

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _list_as_vllm_gives_it(cls, value: object) -> object:
        return json_list(value)

    @field_validator("root_path")
    @classmethod
    def _root_path_is_a_path(cls, root_path: str) -> str:
        return check_root_path(root_path)

    @model_validator(mode="after")
    def _check_http(self) -> ServeConfig:
        """TLS files that load as a pair; the CORS companions only with the origins they qualify."""
        check_tls(self.ssl_keyfile, self.ssl_certfile, self.ssl_ca_certs, self.ssl_cert_reqs)
        if self.allowed_origins is None:
            companions = {"--allowed-methods": self.allowed_methods != ["*"],
                          "--allowed-headers": self.allowed_headers != ["*"],
                          "--allow-credentials": self.allow_credentials}
            given = [flag for flag, is_given in companions.items() if is_given]
            if given:
                raise ValueError(f"{given[0]} qualifies CORS, which is off without --allowed-origins: give "
                                 "the origins too (vLLM allows any origin by default; pdserve, none)")
        return self

    @field_validator("api_key")
    @classmethod
    def _api_key_is_a_key(cls, key: str | None) -> str | None:
        # An empty key (PDSERVE_API_KEY from a Secret with no value) would otherwise turn the check off.
        if key is not None and not key.strip():
            raise ValueError("--api-key is empty: give a key, or leave it unset to serve /v1 without one")
        return key

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _traces_can_be_sent(cls, endpoint: str | None) -> str | None:
        return endpoint if endpoint is None else check_endpoint(endpoint)

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_memory_parses(cls, value: str | int | float | None) -> str | int | float | None:
        if value is not None:
            parse_memory(value)
        return value

    @field_validator("model")
    @classmethod
    def _model_is_a_dir_or_an_id(cls, model: str | None) -> str | None:
        if model is not None:
            check_model_name(model)  # its form only: the id is resolved at start (gateway/startup.py)
        return model

    @model_validator(mode="after")
    def _revision_of_an_id(self) -> ServeConfig:
        if self.revision is not None and (self.model is None or is_local_path(self.model)):
            raise ValueError("--revision applies to a Hugging Face model id given as --model, not to a "
                             "directory or the default model")
        return self

    @model_validator(mode="after")
    def _check_layout(self) -> ServeConfig:
        """The roles (none given: 1 prefill + 1 decode), and the settings that go with a layout."""
        if self.prefill is None and self.decode is None and self.mixed is None:
            self.prefill, self.decode = 1, 1
        if self.fleet_name is not None and self.ray_address is None:
            raise ValueError("--fleet-name keeps the workers beyond the gateway process, in a Ray cluster "
                             "that outlives it: give --address too (a local Ray ends with the gateway)")
        self._check_scale()
        auto = "--scale auto" if self.scale == "auto" else "--ratio auto"
        (_, prefill_tp), (_, decode_tp) = self.tp_degrees()
        if self.is_auto and prefill_tp != decode_tp:
            raise ValueError(f"--prefill-tp {prefill_tp} / --decode-tp {decode_tp}: {auto} moves "
                             "workers between roles, and a worker's ranks are fixed at its start: give both "
                             "roles one degree")
        if self.is_auto and self.backend == "torch":
            raise ValueError(f"{auto} moves workers between roles, which the torch backend's fixed "
                             "process group cannot: use --backend nixl")
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

    @model_validator(mode="after")
    def _check_device_and_model(self) -> ServeConfig:
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

    @model_validator(mode="after")
    def _layout_can_serve(self) -> ServeConfig:
        prefill, decode, mixed = self.prefill or 0, self.decode or 0, self.mixed or 0
        if not can_serve({Role.PREFILL: prefill, Role.DECODE: decode, Role.MIXED: mixed}):
            raise ValueError(f"--prefill/--decode/--mixed: {prefill} prefill + {decode} decode + {mixed} "
                             f"mixed {CANNOT_SERVE}")
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

    def tp_degrees(self) -> tuple[tuple[str, int], tuple[str, int]]:
        """(the flag that sets it, the degree) of the prefill workers, then of the decode and mixed ones."""
        return (("--prefill-tp", self.prefill_tp) if self.prefill_tp else
                ("--tensor-parallel-size", self.tensor_parallel_size),
                ("--decode-tp", self.decode_tp) if self.decode_tp else
                ("--tensor-parallel-size", self.tensor_parallel_size))

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS
