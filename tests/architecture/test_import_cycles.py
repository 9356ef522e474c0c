"""No import cycle among product modules, and none between tests/ and benchmarks/: a small AST pass.

Every import counts, those under `if TYPE_CHECKING:` and inside functions too (a cycle of knowledge is still
a cycle: neither module can be read, moved or tested without the other). `from pkg import name` imports the
module pkg.name where there is one, else pkg itself (its __init__). Tarjan's strongly connected components
name each cycle whole. /work/shared/tools/cycles.py --typed counts the same way, from the command line, less
a module's imports of its own package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decode_pool", "gateway", "kv_transfer", "llm_engine", "loadgen", "pdserve", "pool_worker",
            "prefill_pool", "tuner", "worker_runtime")
# A test of a benchmark script, which it also runs: it imports the script's own knowledge of where vLLM's
# client lives. Nothing under benchmarks/ imports tests/, so this is one way, not a cycle.
TESTS_OF_BENCHMARKS = {"tests.bench.test_vllm_bench_client"}


def module_names(root: Path, top: str) -> dict[str, Path]:
    names = {}
    for path in (root / top).rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path) -> Iterator[str]:
    """Every module `name` imports (dotted names, product or not), wherever the import statement is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from this module's package
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(name, path):
            while imported and imported not in modules:  # `from pkg import X`: X is no module, pkg is
                imported = imported.rpartition(".")[0]
            # A module's import of its own package counts too (cycles.py skips it): where the package's
            # __init__ imports that module, the name may not be defined yet, depending on who came first.
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: set[frozenset[str]] = set()

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.add(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def product_cycles() -> set[frozenset[str]]:
    modules = {name: path for top in PACKAGES for name, path in module_names(ROOT, top).items()}
    return cycles(import_graph(modules))


def test_no_import_cycle_among_product_modules() -> None:
    assert sorted(map(sorted, product_cycles())) == [], "import cycles (cut one edge of each)"


def test_tests_and_benchmarks_import_neither_each_other() -> None:
    wrong = [f"{name} imports {imported}"
             for top, other in (("tests", "benchmarks"), ("benchmarks", "tests"))
             for name, path in sorted(module_names(ROOT, top).items()) if name not in TESTS_OF_BENCHMARKS
             for imported in imports_of(name, path) if imported.split(".")[0] == other]
    assert wrong == []


def test_the_pass_sees_type_only_local_and_from_package_imports(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.c import C\n",
        "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.a import A\n",
        "pkg/c.py": "import os\nfrom lib import X\nC = 1\n",  # X is lib's own: an import of lib
        "pkg/d.py": "from pkg import C\n",  # pkg's own C: an import of pkg (its __init__ imports no d)
        "lib/__init__.py": "X = 1\n",
    }
    for file, text in files.items():
        (tmp_path / file).parent.mkdir(exist_ok=True)
        (tmp_path / file).write_text(text)
    graph = import_graph(module_names(tmp_path, "pkg") | module_names(tmp_path, "lib"))
    assert graph == {"pkg": {"pkg.c"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"lib"},
                     "pkg.d": {"pkg"}, "lib": set()}
    assert cycles(graph) == {frozenset({"pkg.a", "pkg.b"})}
