"""`pdserve serve` settings: the example YAML loads, bad values name the flag, flags override the file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import ServeConfig
from pool_worker import Role

EXAMPLE = Path(__file__).parents[2] / "deploy" / "serve.example.yaml"


def test_example_config_loads_and_flags_override() -> None:
    config = ServeConfig.from_yaml(EXAMPLE, prefill=2, port=None)
    assert (config.prefill, config.decode, config.port, config.is_loopback) == (2, 1, 8000, True)


def test_unknown_and_invalid_settings_are_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefil: 2\n")
    with pytest.raises(ValidationError, match="prefil"):
        ServeConfig.from_yaml(bad)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        ServeConfig(decode=-1)
    with pytest.raises(ValidationError, match="cannot serve"):
        ServeConfig(decode=0)
    with pytest.raises(ValidationError, match="old name of --mixed"):
        ServeConfig(mixed=2, colocated=3)
    with pytest.raises(ValidationError, match="torch backend"):
        ServeConfig(ratio="auto", backend="torch")


def test_roles_not_named_are_zero_unless_none_is() -> None:
    default = ServeConfig()
    assert (default.prefill, default.decode, default.mixed) == (1, 1, None)
    assert ServeConfig(mixed=2).deployment_config("m").layout() == ServeConfig(colocated=2).deployment_config(
        "m").layout() == {Role.PREFILL: 0, Role.DECODE: 0, Role.MIXED: 2}
    assert ServeConfig(prefill=1, mixed=1).deployment_config("m").layout() == {
        Role.PREFILL: 1, Role.DECODE: 0, Role.MIXED: 1}


def test_cli_names_the_bad_flag() -> None:
    result = subprocess.run([sys.executable, "-m", "commands", "serve", "--decode", "0"],
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "--decode" in result.stderr
    missing = subprocess.run([sys.executable, "-m", "commands", "serve", "--model", "/no/such/dir"],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "--model" in missing.stderr and "does not exist" in missing.stderr
