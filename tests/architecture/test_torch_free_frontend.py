"""A frontend process of `pdserve serve --api-server-count N` (gateway/frontends.py frontend_app) imports
neither torch nor the engine nor the worker stack: checked in a fresh interpreter, since this one has torch.

What it imports: its entry point and create_app's modules (the app, its lifespans, every HTTP route), the
link to the fleet actor, the request path, and the contracts it reads (the stages' messages, the worker's
load and info records, pool_worker.api). It then reads its settings as frontend_app does: the supervisor
wrote them with the device and dtype it resolved, so that nothing asks torch about "auto".
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FRONTEND_MODULES = (
    "gateway.frontends", "gateway.app", "gateway.lifespans", "gateway.control.remote_fleet",
    "gateway.control.fleet_client", "gateway.requests.service", "gateway.config",
    "prefill_pool.messages", "decode_pool.messages", "kv_transfer.messages", "worker_runtime.load",
    "worker_runtime.info", "pool_worker.api", "llm_engine.params", "llm_engine.finish_reason",
)
# Never in a frontend: torch, the engine and its kernels, the worker actor and the workers it runs.
FORBIDDEN = (
    "torch", "llm_engine.engine", "llm_engine.model_runner", "llm_engine.model_loader",
    "llm_engine.custom_ops", "llm_engine.tensor_parallel", "pool_worker.actor", "prefill_pool.worker",
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
