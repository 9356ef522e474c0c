"""The README's quick start, line by line, against a real server: every command of its shell block runs and
succeeds, needing no file from outside the repository.

Three things differ from a reader's run, and only these: the server is the tiny random Llama with SmolLM2's
tokenizer (served under the default model's name, so the curl bodies are the README's own) on a free port
instead of `make serve` on 8000; `.venv/bin/pdserve` is this interpreter's `python -m pdserve`, run in a
scratch directory; and `tune profile` is given that tiny model (the reader's profiles the default model).
curl gets --fail-with-body, so that an HTTP error fails the line (as a reader would notice it)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.servers import free_port, serve_config, serving

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def quick_start_commands() -> list[str]:
    """The shell commands of the README's quick start, as bash reads them: a command goes on over a trailing
    backslash or an open quote; comment lines are dropped."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands, pending = [], ""
    for block in re.findall(r"```bash\n(.*?)```", section, re.S):
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending = f"{pending}\n{line}" if pending else line
            try:
                shlex.split(pending, comments=True)
            except ValueError:  # an open quote: the command goes on
                continue
            if not pending.endswith("\\"):
                commands.append(pending)
                pending = ""
    return commands


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir: Path, ray_local: None) -> Iterator[str]:
    config = serve_config(tiny_chat_model_dir, served_model_name=DEFAULT_MODEL_NAME, api_key=None,
                          backend="nixl", port=free_port(), max_waiting=64, kv_cache_mib=8)
    with serving(config) as (url, _):
        yield url


def as_run_here(command: str, url: str, model_dir: Path) -> str:
    command = command.replace("http://127.0.0.1:8000", url).replace("127.0.0.1:8000", url)
    command = command.replace(".venv/bin/pdserve", f"{shlex.quote(sys.executable)} -m pdserve")
    if command.startswith("curl "):
        command = "curl --fail-with-body " + command[len("curl "):]
    if " pdserve bench" in command and "--url" not in command:
        command += f" --url {url} --disable-tqdm"
    if " pdserve tune profile" in command:
        command += f" --model {shlex.quote(str(model_dir))} --no-progress"
    if " pdserve tune plan" in command:
        command += " --no-progress"
    return command


def test_the_quick_start_runs_line_by_line(server: str, tiny_chat_model_dir: Path, tmp_path: Path) -> None:
    commands = quick_start_commands()
    assert commands[0].startswith("make serve")  # the server this test stands in for
    assert any(" bench " in c for c in commands) and any("tune plan" in c for c in commands)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in commands[1:]:
        assert "../" not in command, f"the quick start reaches outside the repository: {command}"
        line = as_run_here(command, server, tiny_chat_model_dir)
        result = subprocess.run(["bash", "-o", "pipefail", "-c", line], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert (tmp_path / "bench-out" / "summary.json").is_file()
    assert (tmp_path / "tune" / "plan.json").is_file()
