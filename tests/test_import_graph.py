"""The import graph of ascendfactory/ and backends/ against DESIGN.md's house rules, read from the source
(every import statement, the lazy ones inside functions included):

    ascendfactory -> backends.contract (+ engines' capabilities.py, loaded by name)
    backends.<engine> -> backends.models, backends.common -> backends.kernels; all -> backends.contract
    backends.contract imports the standard library only; no engine imports another; no circle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("llm", "lf", "mm", "rl")
OURS = ("ascendfactory", "backends")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for top in OURS for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """Every module `name` imports (ours resolved to the module file: `from x import y` is x.y where y is a
    module), third-party and stdlib names as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            submodules = [f"{source}.{a.name}" for a in node.names if f"{source}.{a.name}" in modules]
            if len(submodules) < len(node.names):
                found.add(source)
            found.update(submodules)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _ours(target: str) -> bool:
    return target.split(".")[0] in OURS


def _layer(module: str) -> str:
    """ascendfactory, backends.contract, backends.kernels, backends.models, backends.common or backends.<engine>."""
    parts = module.split(".")
    return parts[0] if parts[0] == "ascendfactory" or len(parts) == 1 else ".".join(parts[:2])


def _breaking(graph, allowed) -> list[str]:
    return sorted(f"{m} imports {t}" for m, targets in graph.items() for t in targets
                  if _ours(t) and not allowed(_layer(m), _layer(t), m, t))


def test_backends_never_import_the_orchestrator(graph):
    assert _breaking(graph, lambda a, b, m, t: not (a != "ascendfactory" and b == "ascendfactory")) == []


def test_the_orchestrator_imports_only_the_contract(graph):
    """ascendfactory reads engines through their capabilities.py (importlib, by name) and rendered files; the
    one import of engine-side code is `ascendfactory env` naming the kernels this machine would use."""
    def allowed(a, b, m, t):
        return a != "ascendfactory" or b in ("ascendfactory", "backends.contract") or (
            m == "ascendfactory.environment" and b == "backends.kernels")
    assert _breaking(graph, allowed) == []


def test_the_contract_is_standard_library_only(graph):
    contract = {m: targets for m, targets in graph.items() if _layer(m) == "backends.contract"}
    assert contract, "backends/contract is missing"
    outside = sorted(f"{m} imports {t}" for m, targets in contract.items() for t in targets
                     if _layer(t) != "backends.contract" and t.split(".")[0] not in sys.stdlib_module_names
                     and t != "__future__")
    assert outside == []


def test_engine_capabilities_import_only_the_contract(graph):
    for engine in ENGINES:
        targets = graph[f"backends.{engine}.capabilities"]
        assert all(_layer(t) == "backends.contract" or t.split(".")[0] in sys.stdlib_module_names
                   or t == "__future__" for t in targets), (engine, targets)


def test_no_engine_imports_another(graph):
    def allowed(a, b, m, t):
        engine_a, engine_b = a.rpartition(".")[2], b.rpartition(".")[2]
        return not (engine_a in ENGINES and engine_b in ENGINES and a != b)
    assert _breaking(graph, allowed) == []


# Which layers each layer may import (its own always; "backends" is the bare package, empty).
BELOW = {
    "backends.contract": set(),
    "backends.kernels": {"backends.contract"},
    "backends.common": {"backends.contract", "backends.kernels"},
    "backends.models": {"backends.contract", "backends.kernels", "backends.common"},
    **{f"backends.{e}": {"backends.contract", "backends.kernels", "backends.common", "backends.models"}
       for e in ENGINES},
}


def test_layers_point_one_way(graph):
    def allowed(a, b, m, t):
        return a == "ascendfactory" or a == b or b == "backends" or b in BELOW.get(a, set())
    assert set(BELOW) | {"ascendfactory", "backends"} >= {_layer(m) for m in graph}, "a new layer needs a rule"
    assert _breaking(graph, allowed) == []


def _circles(graph) -> list[list[str]]:
    """Strongly connected groups of two or more modules. A module's import of one of its own parent packages
    is left out: `from . import name` inside a package reads the package being initialised, not a circle."""
    edges = {m: {t for t in targets if t in graph and t != m and not m.startswith(t + ".")}
             for m, targets in graph.items()}
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in edges:
        if v not in index:
            visit(v)
    return groups


def test_no_import_circle(graph):
    assert _circles(graph) == []


def test_the_checks_catch_what_they_name():
    """Each rule fails on a graph that breaks it."""
    assert _circles({"a.x": {"a.y"}, "a.y": {"a.x"}}) == [["a.x", "a.y"]]
    assert _breaking({"backends.rl.recipe": {"backends.llm.loading"}},
                     lambda a, b, m, t: not (a != b and {a, b} <= {f"backends.{e}" for e in ENGINES})) != []
    bad = {"backends.common.trainer": {"backends.models.decoder"}}
    assert _breaking(bad, lambda a, b, m, t: a == b or b in BELOW.get(a, set())) != []
