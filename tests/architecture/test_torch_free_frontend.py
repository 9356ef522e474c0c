"""A frontend process of `pdserve serve --api-server-count N` (gateway/frontends.py frontend_app) imports
neither torch nor the engine nor the worker stack: checked in a fresh interpreter, since this one has torch.

What it imports: its entry point and create_app's modules (the app, its lifespans, every HTTP route), the
link to the fleet actor, the request path, and the contracts it reads (the stages' messages, the worker's
load and info records, pool_worker.api), and the actor classes whose handles it unpickles (Ray imports
them). It then reads its settings as frontend_app does: the supervisor wrote them with the device and dtype it
resolved, so that nothing asks torch about "auto". At run time it loads the tokenizer class the supervisor
chose (the second test); tests/gateway/test_frontends.py checks that no torch library is mapped in a
serving frontend's memory.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

FRONTEND_MODULES = (
    "gateway.frontends", "gateway.app", "gateway.lifespans", "gateway.control.remote_fleet",
    "gateway.control.fleet_client", "gateway.requests.service", "gateway.config",
    "prefill_pool.messages", "decode_pool.messages", "kv_transfer.messages", "worker_runtime.load",
    "worker_runtime.info", "pool_worker.api", "llm_engine.params", "llm_engine.finish_reason",
    # Ray imports an actor's class wherever one of its handles is unpickled (to read its methods): the
    # frontend gets the workers' and the fleet actor's handles from the fleet.
    "pool_worker.actor", "gateway.control.fleet_actor",
)
# Never in a frontend: torch, the engine and its kernels, the workers a worker actor runs.
FORBIDDEN = (
    "torch", "llm_engine.engine", "llm_engine.model_runner", "llm_engine.model_loader",
    "llm_engine.custom_ops", "llm_engine.tensor_parallel", "pool_worker.engine_start", "prefill_pool.worker",
    "decode_pool.worker", "worker_runtime.step_worker",
)

PROBE = """
import importlib, json, pkgutil, sys
for name in {modules}:
    importlib.import_module(name)
import gateway.api
for info in pkgutil.walk_packages(gateway.api.__path__, "gateway.api."):
    importlib.import_module(info.name)
from gateway.config import ServeConfig
ServeConfig.model_validate(ServeConfig(device="cpu", dtype="float32").model_dump(mode="json"))
print(json.dumps(sorted(sys.modules)))
"""


def frontend_modules() -> set[str]:
    """Every module a fresh interpreter holds once it imported what a frontend imports."""
    result = subprocess.run([sys.executable, "-c", PROBE.format(modules=FRONTEND_MODULES)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def test_a_frontend_imports_no_torch_engine_or_worker_stack() -> None:
    loaded = frontend_modules()
    assert "gateway.api.generate_routes" in loaded  # the probe did import the routes
    found = sorted(m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert found == []


TOKENIZER_PROBE = """
import json, sys
from gateway.api.sampling_defaults import read_sampling_defaults
from llm_engine.model_files import load_tokenizer
tokenizer = load_tokenizer({model_dir!r}, {class_name!r})
ids = tokenizer.apply_chat_template([{{"role": "user", "content": "Hello there"}}], tokenize=True,
                                    add_generation_prompt=True, return_dict=True)["input_ids"]
read_sampling_defaults("auto", {model_dir!r})
print(json.dumps({{"ids": ids, "text": tokenizer.decode(ids), "torch": "torch" in sys.modules}}))
"""


def test_a_frontend_loads_the_tokenizer_the_supervisor_chose_without_torch(tiny_chat_model_dir: Path) -> None:
    """At run time too: the frontend loads the tokenizer class AutoTokenizer picked in the supervisor
    (FrontendSpec.tokenizer_class) and reads the model's sampling defaults, with no torch; the class renders
    and encodes as AutoTokenizer's tokenizer does."""
    from llm_engine.model_files import load_tokenizer, tokenizer_class_name

    reference = load_tokenizer(tiny_chat_model_dir)
    expected = reference.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=True,
                                             add_generation_prompt=True, return_dict=True)["input_ids"]
    probe = TOKENIZER_PROBE.format(model_dir=str(tiny_chat_model_dir),
                                   class_name=tokenizer_class_name(tiny_chat_model_dir))
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.splitlines()[-1])
    assert loaded == {"ids": expected, "text": reference.decode(expected), "torch": False}


CPU_BUILD_PROBE = """
import json, sys
from gateway.config import ServeConfig
from kv_transfer.registry import _nixl_is_available
from llm_engine.hardware import check_device_present, resolve_device
config = ServeConfig(model={model_dir!r})
check_device_present(resolve_device(config.device or "auto"))
print(json.dumps({{"device": resolve_device("auto"), "nixl": _nixl_is_available(),
                  "torch": "torch" in sys.modules}}))
"""


def test_the_supervisor_and_fleet_actor_checks_import_no_torch_on_a_cpu_build(tiny_chat_model_dir: Path
                                                                              ) -> None:
    """What `pdserve serve`'s supervisor checks before Ray starts (the settings, `--device auto`), and what
    the fleet actor resolves `--backend auto` with, hold no torch where torch is a CPU build: it would cost
    each process 1.4 CPU-s (nixl's own import asks torch its CUDA version) to learn what such a build cannot
    have."""
    if not importlib.metadata.version("torch").endswith("+cpu"):
        pytest.skip("torch here is not a CPU build: asking it whether it sees a GPU imports it")
    probe = CPU_BUILD_PROBE.format(model_dir=str(tiny_chat_model_dir))
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout.splitlines()[-1])
    assert answer == {"device": "cpu", "nixl": importlib.util.find_spec("nixl") is not None, "torch": False}
