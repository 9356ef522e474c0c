"""The HTTP server and its edge, under vLLM's names: address, TLS, root path, CORS, frontends, keys,
traces (checked with gateway/http_settings.py; turned into uvicorn's options by serve_settings.py)."""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import NoDecode

from gateway.http_settings import check_root_path, check_tls, json_list
from gateway.telemetry.tracing import check_endpoint

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class HttpSettings(BaseModel):
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

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _list_as_vllm_gives_it(cls, value: object) -> object:
        return json_list(value)

    @field_validator("root_path")
    @classmethod
    def _root_path_is_a_path(cls, root_path: str) -> str:
        return check_root_path(root_path)

    @model_validator(mode="after")
    def _check_http(self) -> Self:
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

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS
