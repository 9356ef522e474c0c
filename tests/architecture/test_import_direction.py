"""Dependencies flow one way (docs/design.md, "Where the code lives"): a small AST pass over every product
module fails when a package, or a wing of the gateway, imports against the allowed direction.

Imports inside `if TYPE_CHECKING:` count too: a type-only import upward is still a wrong-way dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each unit may import the units listed for it (and itself); anything else in this table is forbidden.
# The worker side reads top-down: pool_worker (the Ray actor) → prefill_pool / decode_pool (the roles) →
# worker_runtime (what runs an engine in a worker process; its `roles` module, the Role enum, is a leaf).
# pool_worker.api is a leaf too: what the gateway knows of the worker side (the actor's class by name, the
# errors of its calls), torch-free, so that a frontend process never imports the worker stack.
ALLOWED: dict[str, set[str]] = {
    "pdserve": {"gateway", "gateway.api", "gateway.control", "gateway.ratio", "gateway.requests",
                 "gateway.fleet",
                 "gateway.telemetry", "pool_worker", "worker_runtime", "worker_runtime.roles",
                 "kv_transfer", "llm_engine", "loadgen", "tuner"},
    # app.py and config.py: the composition root of the server
    "gateway": {"gateway.api", "gateway.control", "gateway.ratio", "gateway.requests", "gateway.fleet",
                "gateway.telemetry",
                "pool_worker", "pool_worker.api", "worker_runtime", "worker_runtime.roles", "kv_transfer",
                "llm_engine"},
    "gateway.api": {"gateway.control", "gateway.ratio", "gateway.requests", "gateway.fleet",
                    "gateway.telemetry",
                    "worker_runtime.roles", "llm_engine"},
    # the fleet's owner (in this process or a named actor) and the frontends' link to it
    "gateway.control": {"gateway.ratio", "gateway.requests", "gateway.fleet", "gateway.telemetry",
                        "worker_runtime.roles", "worker_runtime", "tuner", "loadgen"},
    # the controller's planner replays traffic through the tuner's simulator
    "gateway.ratio": {"gateway.requests", "gateway.fleet", "gateway.telemetry", "worker_runtime.roles",
                      "worker_runtime", "tuner", "loadgen"},
    "gateway.requests": {"gateway.fleet", "gateway.telemetry", "worker_runtime.roles", "worker_runtime",
                         "prefill_pool.messages", "decode_pool.messages", "kv_transfer", "llm_engine"},
    "gateway.fleet": {"pool_worker", "pool_worker.api", "worker_runtime.roles", "worker_runtime",
                      "prefill_pool.messages", "decode_pool.messages", "kv_transfer", "llm_engine"},
    "gateway.telemetry": {"worker_runtime", "worker_runtime.roles"},
    "pool_worker": {"pool_worker.api", "prefill_pool", "decode_pool", "prefill_pool.messages",
                    "decode_pool.messages", "worker_runtime", "worker_runtime.roles", "kv_transfer",
                    "llm_engine"},
    "prefill_pool": {"prefill_pool.messages", "worker_runtime", "worker_runtime.roles", "kv_transfer",
                     "llm_engine"},
    "prefill_pool.messages": {"kv_transfer", "llm_engine"},
    "decode_pool": {"decode_pool.messages", "prefill_pool.messages", "worker_runtime",
                    "worker_runtime.roles", "kv_transfer", "llm_engine"},
    "decode_pool.messages": {"kv_transfer", "llm_engine"},
    "worker_runtime": {"worker_runtime.roles", "pool_worker.api", "kv_transfer", "llm_engine"},
    "tuner": {"loadgen", "kv_transfer", "llm_engine"},  # the simulator and profiler; never the gateway
    "loadgen": {"llm_engine"},
    "worker_runtime.roles": set(),
    "pool_worker.api": set(),
    "kv_transfer": set(),
    "llm_engine": set(),
}
# Longest prefix first: a module belongs to the most specific unit that names it.
UNITS = sorted(ALLOWED, key=len, reverse=True)
PACKAGES = {unit.split(".")[0] for unit in ALLOWED}


def unit_of(module: str) -> str | None:
    for unit in UNITS:
        if module == unit or module.startswith(unit + "."):
            return unit
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from gateway import api` imports the module gateway.api
                name = f"{node.module}.{alias.name}"
                where = ROOT / name.replace(".", "/")
                is_module = where.is_dir() or where.with_suffix(".py").exists()
                found.append((node.lineno, name if is_module else node.module))
    return found


def wrong_way_imports() -> list[str]:
    problems = []
    for package in sorted(PACKAGES):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = unit_of(module_name(path))
            assert source is not None, path
            for line, target_module in imported_modules(path):
                target = unit_of(target_module)
                if target is None or target == source:
                    continue
                if target not in ALLOWED[source]:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: {source} imports {target_module} "
                                    f"({target})")
    return problems


def test_every_import_goes_the_allowed_way() -> None:
    assert wrong_way_imports() == []


def test_the_pass_sees_a_wrong_way_import(tmp_path: Path) -> None:
    # The checker itself: an engine module that imports the gateway is reported.
    assert "gateway" not in ALLOWED["llm_engine"]
    assert unit_of("gateway.requests.router") == "gateway.requests"
    assert unit_of("pool_worker.actor") == "pool_worker"
    assert unit_of("worker_runtime.step_loop") == "worker_runtime"
    assert unit_of("worker_runtime.roles") == "worker_runtime.roles"
    bad = tmp_path / "bad.py"
    bad.write_text("from gateway.fleet.deployment import PDDeployment\nimport llm_engine\n")
    assert sorted({m for _, m in imported_modules(bad)}) == ["gateway.fleet.deployment", "llm_engine"]
