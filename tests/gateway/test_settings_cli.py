"""`pdserve serve`'s flags, environment variables and help, generated over every ServeConfig field: a field
added with a description gets all three, and this test checks them (flags > env > YAML > defaults)."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest

from gateway.config import SCALE_BOUNDS, ServeConfig
from pdserve.main import build_parser
from pdserve.serve import load_serve_config
from pdserve.settings_cli import _value_type, env_name, flag_name
from tests.helpers.tls import self_signed

FIELDS = list(ServeConfig.model_fields)


# Text fields whose values are checked: a valid one each.
VALID_TEXT = {"otlp_traces_endpoint": "http://localhost:4318/v1/traces", "kv_cache_memory": "2GiB",
              "fleet_name": "main", "device": "cpu", "chat_template": "{{ messages[0].content }}",
              "generation_config": "vllm", "root_path": "/llm", "quantization": "compressed-tensors"}
# List fields: a value each (given as vLLM gives it, a JSON list).
VALID_LISTS = {"allowed_origins": ["https://app.example"], "allowed_methods": ["GET", "POST"],
               "allowed_headers": ["Authorization"]}


def sample(field: str, tmp_path: Path) -> Any:
    """A valid value for `field` that is not its default."""
    if field == "model":
        return str(tmp_path)
    if field == "profile":
        (tmp_path / "profile.json").write_text("{}")
        return str(tmp_path / "profile.json")
    if field in VALID_TEXT:
        return VALID_TEXT[field]
    if field in VALID_LISTS:
        return VALID_LISTS[field]
    if field in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):  # a pair: base_flags gives the rest
        keyfile, certfile = self_signed(tmp_path)
        return str(keyfile if field == "ssl_keyfile" else certfile)
    if field == "ssl_cert_reqs":
        return 2
    if field == "gpu_memory_utilization":  # a share, with --device cuda (base_flags)
        return 0.5
    if field == "max_logprobs":  # its default is its bound
        return 5
    info = ServeConfig.model_fields[field]
    kind = _value_type(info.annotation)
    if kind is bool:
        return not info.default
    if kind is int:
        return 3 if info.default is None else info.default + 1
    if kind is float:
        return 2.5 if info.default is None else info.default * 2
    if typing.get_origin(kind) is typing.Literal:
        return next(c for c in typing.get_args(kind) if c != info.default and c != "float16")
    if typing.get_origin(kind) is dict:
        return {"a": "b"} if typing.get_args(kind)[1] is str else {"a": 1.5}
    return "some-value"


def as_text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict | list) else str(value)


def base_flags(field: str, tmp_path: Path) -> list[str]:
    # A layout that serves whatever one role count is set to.
    # --revision goes with a model id (its form is checked here; nothing is fetched).
    model = ["--model", "org/name"] if field == "revision" else []
    # The other half of the TLS pair (sample() made both); the CORS companions go with the origins.
    tls = {"ssl_keyfile": tmp_path / "key.pem", "ssl_certfile": tmp_path / "cert.pem"}
    if field in ("ssl_cert_reqs", "ssl_ca_certs"):  # client certificates: over HTTPS, against a CA
        self_signed(tmp_path)
        tls["ssl_ca_certs"] = tmp_path / "cert.pem"
    for other, path in tls.items():
        model += [flag_name(other), str(path)] if other != field and field.startswith("ssl_") else []
    model += ["--allowed-origins", "*"] if field in ("allowed_methods", "allowed_headers",
                                                     "allow_credentials") else []
    model += ["--device", "cuda"] if field == "gpu_memory_utilization" else []
    model += ["--address", "auto"] if field == "fleet_name" else []
    if field == "scale" or field in SCALE_BOUNDS:  # the scale controller's range and profile
        (tmp_path / "profile.json").write_text("{}")
        model += ["--profile", str(tmp_path / "profile.json")]
        model += [] if field == "scale" else ["--scale", "auto"]
        model += [] if field == "max_workers" else ["--max-workers", "3"]
        if field.startswith("min_"):  # 3 (sample()): a starting layout within the range
            return [*model, "--mixed", "3"]
    return model + ([] if field in ("prefill", "decode", "mixed") else ["--mixed", "1"])


def parsed(argv: list[str]) -> ServeConfig:
    return typing.cast(ServeConfig, load_serve_config(build_parser().parse_args(["serve", *argv])))


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_has_a_flag(field: str, tmp_path: Path) -> None:
    value = sample(field, tmp_path)
    flag = flag_name(field)
    argv = [flag if value is not False else flag.replace("--", "--no-", 1)]
    if not isinstance(value, bool):
        argv.append(as_text(value))
    if field in ("prefill", "decode"):
        argv += ["--mixed", "1"]
    assert getattr(parsed(base_flags(field, tmp_path) + argv), field) == value


@pytest.mark.parametrize("field", FIELDS)
def test_every_field_has_an_env_var(field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    value = sample(field, tmp_path)
    monkeypatch.setenv(env_name(ServeConfig, field), as_text(value).lower() if isinstance(value, bool)
                       else as_text(value))
    extra = ["--mixed", "1"] if field in ("prefill", "decode") else []
    assert getattr(parsed(base_flags(field, tmp_path) + extra), field) == value


@pytest.mark.parametrize("field", FIELDS)
def test_help_shows_every_default_and_env_var(field: str) -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    action = next(a for a in serve._actions if a.dest == field and a.help != "==SUPPRESS==")
    default = ServeConfig.model_fields[field].default
    assert env_name(ServeConfig, field) in action.help
    if default is None:
        assert "default" in action.help, f"{field}: say in words what leaving it unset means"
    elif isinstance(default, bool):
        assert f"(default: {'on' if default else 'off'})" in action.help
    elif isinstance(default, list):
        assert f"(default: {' '.join(default)})" in action.help
    else:
        assert f"(default: {default})" in action.help


def test_flags_beat_env_beat_yaml_beat_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("port: 7000\nmax_waiting: 9\n")
    assert parsed(["--config", str(config)]).port == 7000
    monkeypatch.setenv("PDSERVE_PORT", "7001")
    both = parsed(["--config", str(config)])
    assert (both.port, both.max_waiting, both.queue_timeout_s) == (7001, 9, 60.0)
    assert parsed(["--config", str(config), "--port", "7002"]).port == 7002


def test_aliases_and_negations_work() -> None:
    assert parsed(["--address", "auto"]).ray_address == "auto"
    assert parsed(["--ray-address", "auto"]).ray_address == "auto"
    assert parsed(["--no-pin-cpus"]).pin_cpus is False


def test_a_bad_value_names_its_flag_and_where_it_came_from(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--port: .*less than or equal to 65535$"):
        parsed(["--port", "70000"])
    monkeypatch.setenv("PDSERVE_QUEUE_TIMEOUT_S", "-1")
    with pytest.raises(ValueError, match=r"^--queue-timeout-s: .* \(from PDSERVE_QUEUE_TIMEOUT_S\)$"):
        parsed([])
    monkeypatch.delenv("PDSERVE_QUEUE_TIMEOUT_S")
    config = tmp_path / "serve.yaml"
    config.write_text("max_waiting: -2\n")
    with pytest.raises(ValueError, match=rf"^--max-waiting: .* \(from {config}\)$"):
        parsed(["--config", str(config)])
