"""A Hugging Face model id as --model: resolved offline from a pre-filled Hugging Face cache (its own layout:
models--org--name/{blobs, snapshots/<commit>, refs/main}; no network), by the gateway (config, tokenizer) and
by each worker (weights, through its own environment); an id that cannot be resolved fails at start naming
--model."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from gateway.config import ServeConfig
from gateway.serve_settings import deployment_config
from llm_engine import model_files
from llm_engine.model_files import ModelNotFoundError, load_tokenizer, resolve_model, served_name
from pdserve.main import main
from tests.helpers.reference import hf_greedy
from tests.helpers.servers import API_KEY, fleet_output, serve_config, serving
from worker_runtime.model_source import ModelSource

REPO_ID = "acme/tiny-chat"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def fill_hub_cache(hub_cache: Path, repo_id: str, model_dir: Path, skip_weights: bool = False) -> Path:
    """Put `model_dir` into `hub_cache` as huggingface_hub lays a download out; returns the snapshot."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for item in model_dir.iterdir():
        if item.is_file() and not (skip_weights and item.suffix == ".safetensors"):
            blob = repo / "blobs" / hashlib.sha256(item.read_bytes()).hexdigest()
            shutil.copy2(item, blob)
            (snapshot / item.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An offline Hugging Face home: the environment for child processes, and huggingface_hub's constants
    (read from the environment once, at its import) for this one."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    for name, value in (("HF_HOME", str(home)), ("HF_HUB_CACHE", str(cache)), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    model_files._resolve_hub_id.cache_clear()
    yield cache
    model_files._resolve_hub_id.cache_clear()


def test_an_id_resolves_offline_from_the_cache(hub_cache: Path, tiny_chat_model_dir: Path) -> None:
    snapshot = fill_hub_cache(hub_cache, REPO_ID, tiny_chat_model_dir)
    assert resolve_model(REPO_ID, weights=True) == snapshot
    assert resolve_model(REPO_ID, COMMIT, weights=True) == snapshot
    assert ModelSource.named(REPO_ID).resolve_here("node-1") == str(snapshot)
    assert served_name(REPO_ID, snapshot) == REPO_ID  # the id as given, as vLLM names it
    assert served_name(str(tiny_chat_model_dir), tiny_chat_model_dir) == tiny_chat_model_dir.name


def test_every_worker_loads_the_commit_the_gateway_resolved(hub_cache: Path, tiny_chat_model_dir: Path
                                                            ) -> None:
    """Review N9: the workers resolved the id's default branch each on their own, whenever they started;
    they are given the commit the gateway's copy is at, so that a node started later loads the same."""
    snapshot = fill_hub_cache(hub_cache, REPO_ID, tiny_chat_model_dir)
    source = deployment_config(ServeConfig(model=REPO_ID), str(snapshot)).model_source
    assert source == ModelSource(hub_id=REPO_ID, revision=COMMIT)
    assert source.resolve_here("node-1") == str(snapshot)
    # A branch given as --revision is pinned the same way; a directory is never a commit.
    on_main = deployment_config(ServeConfig(model=REPO_ID, revision="main"), str(snapshot))
    assert on_main.model_source.revision == COMMIT
    assert ModelSource.named(REPO_ID, "v1", str(tiny_chat_model_dir)).revision == "v1"


def test_an_unknown_id_offline_says_why(hub_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"acme/nothing is not \(wholly\) in the Hugging Face cache.*"
                                                 "HF_HUB_OFFLINE"):
        resolve_model("acme/nothing", weights=False)


def test_a_worker_refuses_a_cached_copy_without_weights(hub_cache: Path, tiny_llama_dir: Path) -> None:
    snapshot = fill_hub_cache(hub_cache, REPO_ID, tiny_llama_dir, skip_weights=True)
    assert resolve_model(REPO_ID, weights=False) == snapshot  # the gateway needs no weights
    with pytest.raises(FileNotFoundError, match=r"on node node-1: acme/tiny-chat has no \*\.safetensors"):
        ModelSource.named(REPO_ID).resolve_here("node-1")


def test_serve_config_takes_an_id_or_a_directory(tiny_llama_dir: Path) -> None:
    assert ServeConfig(model=REPO_ID, revision="v1").model == REPO_ID  # its form only: no network here
    assert deployment_config(ServeConfig(model=REPO_ID, revision="v1"), str(tiny_llama_dir)).model_source == \
        ModelSource(hub_id=REPO_ID, revision="v1")
    with pytest.raises(ValidationError, match="--revision applies to a Hugging Face model id"):
        ServeConfig(model=str(tiny_llama_dir), revision="v1")
    with pytest.raises(ValidationError, match="does not exist as a directory and is not a Hugging Face"):
        ServeConfig(model="a/b/c")


def test_the_cli_fails_at_start_naming_model(hub_cache: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    # In a child process: huggingface_hub reads HF_HUB_OFFLINE and HF_HOME from the environment itself.
    child = subprocess.run([sys.executable, "-m", "pdserve", "serve", "acme/nothing"], capture_output=True,
                           text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert child.returncode == 2, child.stderr
    message = "pdserve serve: error: --model acme/nothing is not (wholly) in the Hugging Face cache"
    assert message in child.stderr
    assert "HF_HUB_OFFLINE" in child.stderr and "Traceback" not in child.stderr
    assert main(["serve", "a/b/c"]) == 2
    assert "--model: " in capsys.readouterr().err
    assert main(["serve", "acme/one", "--model", "acme/two"]) == 2
    assert "--model: given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "profile", "--model", "acme/nothing", "--out", str(tmp_path / "profile")])
    assert exit_info.value.code == 2
    assert "--model: acme/nothing is not (wholly) in the Hugging Face cache" in capsys.readouterr().err


@pytest.mark.slow  # ~25 s on 2 cores: a whole server
@pytest.mark.usefixtures("ray_local")
def test_a_server_of_an_id_names_it_and_matches_transformers(hub_cache: Path, tiny_chat_model_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """... and reports it as given (/v1/models' root: the id, not this machine's snapshot directory), and
    says each worker's start-up as it happens, in the log and in GET /health (503 "starting") meanwhile."""
    fill_hub_cache(hub_cache, REPO_ID, tiny_chat_model_dir)
    # The workers resolve the id on their node, through their own environment (as on a cluster's nodes).
    worker_env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    config = serve_config(tiny_chat_model_dir, model=REPO_ID, served_model_name=None, worker_env=worker_env)
    starting: list[dict[str, Any]] = []
    with serving(config, starting_answers=starting) as (url, app), httpx.Client(base_url=url, timeout=120,
                                                   headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        [model] = client.get("/v1/models").json()["data"]
        assert (model["id"], model["root"]) == (REPO_ID, REPO_ID)
        said = fleet_output(app)  # the fleet actor says the bring-up
        for line in ("pdserve: starting 2 workers (1 prefill, 1 decode)", "(prefill): placed on node",
                     "(decode): placed on node", "(prefill): loading the model on its node",
                     "(prefill): model loaded in", "(decode): model loaded in",
                     "pdserve: 2 of 2 workers up in"):
            assert line in said, said
        assert starting and all(answer["status"] == "starting" for answer in starting), starting
        roles = {(w["worker_id"], w["role"]) for a in starting for w in a["workers"]}
        assert sorted(role for _, role in roles) == ["decode", "prefill"], starting
        assert {w["phase"] for a in starting for w in a["workers"]} <= {
            "created", "placed", "loading", "loaded"}
        body = {"model": REPO_ID, "prompt": "The quick brown fox", "max_tokens": 5, "temperature": 0,
                "return_token_ids": True}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
    tokenizer = load_tokenizer(tiny_chat_model_dir)
    expected = hf_greedy(tiny_chat_model_dir, [tokenizer.encode("The quick brown fox")], 5)[0]
    assert response.json()["choices"][0]["token_ids"] == expected


def test_an_unsupported_family_stops_serve_at_start_naming_model(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, architectures=["Gemma2ForCausalLM"]
                 ).save_pretrained(tmp_path)
    assert main(["serve", str(tmp_path)]) == 2
    assert f"--model {tmp_path}: unsupported architecture ['Gemma2ForCausalLM']" in capsys.readouterr().err
